//! Label selectors as kubectl takes them (`app=web,tier!=db,env in (a,b),!legacy`), read into
//! kube's [`Selector`] (which matches them). One reader for the config check of
//! `resources[].label_selector` ([`check`]), `tail --selector` and the API test server
//! ([`parse`]).

use kube::core::{Expression, Selector};

/// A selector text that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot read {part:?} as a label requirement (`key=value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`, `key`, `!key`)"
)]
pub struct Error {
    /// The requirement that could not be read.
    pub part: String,
}

/// Checks `text` as the API server reads a label selector: what [`parse`] reads, and also
/// `key>N` and `key<N` (integers), which the API server takes but kube's [`Selector`] cannot
/// hold.
pub fn check(text: &str) -> Result<(), Error> {
    for part in split_top_level(text).into_iter().map(str::trim) {
        let numeric = part
            .split_once(['>', '<'])
            .is_some_and(|(k, n)| label_key(k).is_some() && n.trim().parse::<i64>().is_ok());
        if !part.is_empty() && !numeric && requirement(part).is_none() {
            return Err(Error { part: part.into() });
        }
    }
    Ok(())
}

/// Reads `text`; an empty text selects everything.
pub fn parse(text: &str) -> Result<Selector, Error> {
    split_top_level(text)
        .into_iter()
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| requirement(part).ok_or_else(|| Error { part: part.into() }))
        .collect()
}

/// One requirement of a selector.
fn requirement(part: &str) -> Option<Expression> {
    Some(if let Some(key) = part.strip_prefix('!') {
        Expression::DoesNotExist(label_key(key)?)
    } else if let Some((k, v)) = part.split_once("!=") {
        Expression::NotEqual(label_key(k)?, v.trim().to_owned())
    } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
        Expression::Equal(label_key(k)?, v.trim().to_owned())
    } else if let Some((k, set)) = set_requirement(part, " notin") {
        Expression::NotIn(label_key(k)?, set?)
    } else if let Some((k, set)) = set_requirement(part, " in") {
        Expression::In(label_key(k)?, set?)
    } else {
        Expression::Exists(label_key(part)?)
    })
}

/// Splits at commas outside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn label_key(k: &str) -> Option<String> {
    let k = k.trim();
    let ok = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    ok.then(|| k.to_owned())
}

/// `key in (a,b)` (or `key in(a,b)`): the key and the set (`None` when the set is not in
/// parentheses).
fn set_requirement<'a>(
    part: &'a str,
    op: &str,
) -> Option<(&'a str, Option<std::collections::BTreeSet<String>>)> {
    let (k, rest) = part.split_once(op)?;
    let set = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .map(|r| r.split(',').map(|v| v.trim().to_owned()).collect());
    Some((k, set))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kube::core::SelectorExt;

    use super::*;

    #[test]
    fn selectors_read_like_kubectls() {
        let labels: BTreeMap<String, String> = [("app", "web"), ("tier", "front")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let m = |s: &str| parse(s).unwrap().matches(&labels);
        assert!(m("app=web"));
        assert!(m("app==web,tier"));
        assert!(!m("app!=web"));
        assert!(m("tier in (front, back),!legacy"));
        assert!(!m("tier notin (front)"));
        assert!(m("env notin (prod)"));
        assert!(!m("legacy"));
        assert!(m(""));
        assert!(parse("app in front").is_err());
        assert!(m("tier in(front)") && m("tier notin(a, b)"));
        // The API server also takes integer comparisons; the load check accepts them.
        assert!(check("replicas>1,tier<3,app=web").is_ok());
        assert!(parse("replicas>1").is_err());
        assert_eq!(check("a b=c").unwrap_err().part, "a b=c");
        assert!(check("replicas>x").is_err());
        assert_eq!(parse("a b=c").unwrap_err().part, "a b=c");
        // What kube sends to the API server reads back the same.
        let s = parse("app=web,tier notin (a,b),!legacy").unwrap();
        assert_eq!(parse(&s.to_string()).unwrap(), s);
    }
}
