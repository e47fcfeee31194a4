//! Keeping the agent's heap to what it uses.
//!
//! glibc's allocator keeps what a program frees for its next allocations,
//! and gives memory back on its own only from the top of a heap. The agent
//! allocates in bursts that its steady state never needs again: parsing the
//! kernel's BTF when it loads its programs (about 19 MB at the peak on
//! Linux 6.18, all freed once loaded), decoding a node's pods from the API
//! server, programming a snapshot of a thousand pods, pod churn. Without a
//! trim those pages stay in the agent's RSS, and in its memory cgroup's
//! charge, for as long as it runs. So the agent asks the allocator to
//! return whole free pages (`malloc_trim`) after its own bursts (the
//! programs loaded, a pass that enrolled or removed pods, a full state
//! check) and every [`TRIM_INTERVAL`] for those of other threads (watch
//! events, annotations). A trim walks the free lists: well under a
//! millisecond for the agent's heap.

use std::time::Duration;

/// How often the agent trims whatever its threads have freed.
pub const TRIM_INTERVAL: Duration = Duration::from_secs(30);

/// glibc's malloc gives each thread that allocates its own arena, up to
/// eight per CPU, and freed memory stays in the arena that held it; the
/// agent's work hops between its two workers and the blocking pool, so its
/// heap would be spread (and kept) over many. Two arenas serve it. Call
/// before any thread is started.
pub fn limit_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: called before any thread of the agent is started.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// Returns free heap pages to the kernel (glibc); elsewhere nothing.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers; it only returns free pages of
    // the allocator's own arenas, under their locks, from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// [`release_freed`] every [`TRIM_INTERVAL`], on the blocking pool.
pub async fn release_freed_periodically() {
    let mut tick = tokio::time::interval(TRIM_INTERVAL);
    tick.tick().await;
    loop {
        tick.tick().await;
        let _ = tokio::task::spawn_blocking(release_freed).await;
    }
}
