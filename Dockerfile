# Multi-stage build to a small, non-root image with no shell.
# The build step is the command .ci/run also runs: `cargo build --release --locked`, with the
# default features (bundled librdkafka; the Rust image has gcc, make and OpenSSL headers).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin kube-event-bridge

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kube-event-bridge /usr/local/bin/kube-event-bridge
# The default config (stdout sink); a ConfigMap mounted on /etc/kube-event-bridge replaces it.
COPY config/default.yaml /etc/kube-event-bridge/config.yaml
# distroless' "nonroot" user; the Deployment also sets runAsNonRoot.
USER 65532:65532
# Admin port: /metrics, /healthz, /readyz. No HEALTHCHECK: Kubernetes probes do that.
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/kube-event-bridge"]
CMD ["run", "--config", "/etc/kube-event-bridge/config.yaml"]
