//! What settings validation found wrong: one collector every component's settings report
//! into, each problem with the field path it is about (`sinks[1].kafka.brokers: …`).

/// Problems found so far, each `path: reason`, in the order found.
#[derive(Debug, Default)]
pub struct Problems {
    list: Vec<String>,
}

impl Problems {
    /// No problems yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `path` is wrong because of `reason`.
    pub fn add(&mut self, path: impl std::fmt::Display, reason: impl std::fmt::Display) {
        self.list.push(format!("{path}: {reason}"));
    }

    /// A view that prefixes every path with `prefix` (a section: `kubernetes`, `sinks[2]`).
    pub fn at(&mut self, prefix: impl Into<String>) -> Section<'_> {
        Section {
            problems: self,
            prefix: prefix.into(),
        }
    }

    /// Whether nothing was found.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The problems found, as `path: reason` lines.
    pub fn into_vec(self) -> Vec<String> {
        self.list
    }
}

/// The problems of one section of the settings; paths are relative to it.
pub struct Section<'a> {
    problems: &'a mut Problems,
    prefix: String,
}

impl Section<'_> {
    /// Records that `field` of this section (`page_size`, `retry.qps`, `exclude[0]`, or `""`
    /// for the section itself) is wrong because of `reason`.
    pub fn add(&mut self, field: &str, reason: impl std::fmt::Display) {
        let path = self.path(field);
        self.problems.add(path, reason);
    }

    /// A view of the sub-section `field` of this section.
    pub fn at(&mut self, field: &str) -> Section<'_> {
        let prefix = self.path(field);
        Section {
            problems: self.problems,
            prefix,
        }
    }

    /// `field`'s path: this section's, `.field` appended.
    fn path(&self, field: &str) -> String {
        match (self.prefix.is_empty(), field.is_empty()) {
            (_, true) => self.prefix.clone(),
            (true, false) => field.to_owned(),
            (false, false) => format!("{}.{field}", self.prefix),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_nest_and_keep_their_order() {
        let mut p = Problems::new();
        p.at("kubernetes").add("qps", "must be a positive number");
        let mut sink = p.at("sinks[1]");
        sink.add("", "whole section");
        sink.at("kafka").add("brokers", "at least one");
        p.add("routes", "at least one route is required");
        assert_eq!(
            p.into_vec(),
            [
                "kubernetes.qps: must be a positive number",
                "sinks[1]: whole section",
                "sinks[1].kafka.brokers: at least one",
                "routes: at least one route is required",
            ]
        );
    }
}
