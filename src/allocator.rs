//! The process's allocator: mimalloc instead of glibc's malloc. A sync allocates and frees
//! many short-lived buffers (pages, cached objects, messages), where glibc spends about a
//! third of the process's CPU (docs/src/performance.md). `src/main.rs` declares it the global
//! allocator; the benches that run the pipeline in their own process declare it too
//! (`benches/support`), so that what they measure is what runs.

/// mimalloc's `mi_option_purge_delay` (the 16th of `mi_option_e` in mimalloc.h, v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed memory goes back to the system at once: with mimalloc's default delay (1 s in v3,
/// the version the `mimalloc` crate builds; 10 ms in v2) a sync's peak RSS is about half as
/// large again, for no CPU measured. `MIMALLOC_PURGE_DELAY`, when set, is mimalloc's own
/// setting and is left as it says.
pub fn purge_freed_memory_at_once() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: sets a plain integer option; mimalloc reads options atomically.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option set is the purge delay: before it is set it holds the purge delay's default
    /// (1000 ms in mimalloc v3, or what `MIMALLOC_PURGE_DELAY` says), after it 0. A mimalloc
    /// whose options are numbered otherwise, or that moves to another default, fails here
    /// rather than silently changing another option.
    #[test]
    fn the_option_set_at_start_is_mimallocs_purge_delay() {
        let default = std::env::var("MIMALLOC_PURGE_DELAY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000);
        // SAFETY: reads a plain integer option.
        let before = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(
            before, default,
            "option {MI_OPTION_PURGE_DELAY} is not the purge delay"
        );
        purge_freed_memory_at_once();
        // SAFETY: as above.
        let after = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        // An operator's MIMALLOC_PURGE_DELAY is kept.
        let expected = if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            default
        } else {
            0
        };
        assert_eq!(after, expected);
    }
}
