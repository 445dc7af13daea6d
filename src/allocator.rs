//! The process's allocator: mimalloc instead of glibc's malloc. A sync allocates and frees
//! many short-lived buffers (pages, cached objects, messages), where glibc spends about a
//! third of the process's CPU (docs/src/performance.md). `src/main.rs` declares it the global
//! allocator; the benches that run the pipeline in their own process declare it too
//! (`benches/support`), so that what they measure is what runs. [`configure`] sets it up at
//! the start of `main`.

/// mimalloc's `mi_option_purge_delay` (the 16th of `mi_option_e` in mimalloc.h, v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long freed memory stays mapped before it goes back to the system, in milliseconds.
pub const PURGE_DELAY_MS: std::ffi::c_long = 10;

/// Sets up the allocator and the process's memory; call it first thing in `main`:
/// [`purge_freed_memory_soon`] and [`without_transparent_huge_pages`].
pub fn configure() {
    purge_freed_memory_soon();
    without_transparent_huge_pages();
}

/// Freed memory goes back to the system after [`PURGE_DELAY_MS`]. With mimalloc's default
/// delay (1 s in mimalloc v3, the version the `mimalloc` crate builds; 10 ms in v2) a sync's
/// peak RSS is about half as large again; returning it at once (0) cost each message into
/// Kafka a page fault and a purge of its buffers (a fifth of the CPU per event at ~10 KB),
/// and 10 ms keeps the buffers of a busy stream mapped for no memory measured beyond the
/// spread (docs/src/performance.md). `MIMALLOC_PURGE_DELAY`, when set, is mimalloc's own
/// setting and is left as it says.
pub fn purge_freed_memory_soon() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: sets a plain integer option; mimalloc reads options atomically.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
}

/// Turns transparent huge pages off for this process (`prctl(PR_SET_THP_DISABLE)`, inherited
/// by children). mimalloc asks for them on its whole arena (`madvise(MADV_HUGEPAGE)`, which a
/// host's THP setting `madvise`, the usual default, honours), so a small heap touching a few
/// 64 KiB slices across a 2 MiB range holds all 2 MiB, and purging a slice splits the huge
/// page. Measured here: a 50,000-object sync's peak RSS 86–91 MiB without them against
/// 108–118 with, and four sharded replicas 73–89 MiB each against 120–137
/// (docs/src/performance.md); no CPU cost measured. The kernel checks the setting at each
/// fault, so memory mimalloc mapped (and advised) before `main` is covered too.
/// `MIMALLOC_ALLOW_THP`, when set, is mimalloc's own setting and is left as it says (`0`
/// makes mimalloc turn them off itself; `1` keeps them).
pub fn without_transparent_huge_pages() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
        return;
    }
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments and touches no memory of ours.
    let failed = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } != 0;
    if failed {
        // A kernel without it (before 3.15) or a seccomp profile refusing it: huge pages
        // only cost memory, so the process goes on (logging is not set up yet).
        eprintln!(
            "Cannot turn transparent huge pages off for this process (prctl: {}); memory use may be higher",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option set is the purge delay: before it is set it holds the purge delay's default
    /// (1000 ms in mimalloc v3, or what `MIMALLOC_PURGE_DELAY` says), after it
    /// [`PURGE_DELAY_MS`]. A mimalloc whose options are numbered otherwise, or that moves to
    /// another default, fails here rather than silently changing another option.
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
        purge_freed_memory_soon();
        // SAFETY: as above.
        let after = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        // An operator's MIMALLOC_PURGE_DELAY is kept.
        let expected = if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            default
        } else {
            PURGE_DELAY_MS
        };
        assert_eq!(after, expected);
    }

    /// After it the kernel reports transparent huge pages off for the process (unless the
    /// environment set mimalloc's own option; then mimalloc decides).
    #[test]
    fn transparent_huge_pages_are_off_after_it() {
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
            return;
        }
        without_transparent_huge_pages();
        // SAFETY: as in `without_transparent_huge_pages`.
        let disabled = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(disabled, 1, "PR_GET_THP_DISABLE after the call");
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        assert!(
            status
                .lines()
                .any(|l| l.split_whitespace().eq(["THP_enabled:", "0"])),
            "/proc/self/status says THP off: {status}"
        );
    }
}
