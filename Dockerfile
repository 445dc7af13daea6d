# Multi-stage build to a small non-root image. The build step is the same command CI runs.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin kube-event-bridge

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kube-event-bridge /usr/local/bin/kube-event-bridge
COPY config/default.yaml /etc/kube-event-bridge/config.yaml
USER nonroot:nonroot
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/kube-event-bridge"]
CMD ["run", "--config", "/etc/kube-event-bridge/config.yaml"]
