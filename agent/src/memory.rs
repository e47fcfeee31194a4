//! Handing the heap memory the agent has freed back to the kernel.
//!
//! glibc's allocator keeps what a program frees for its next allocations,
//! and gives memory back on its own only from the top of a heap. The agent
//! allocates in bursts that its steady state never needs again: parsing the
//! kernel's BTF when it loads its programs (about 19 MB at the peak on
//! Linux 6.18, all freed once loaded), decoding a node's pods from the API
//! server, programming a snapshot of a thousand pods. Without a trim, those
//! pages stay in the agent's RSS and in its memory cgroup's charge for as
//! long as it runs. So after each burst the agent asks the allocator to
//! return whole free pages (`malloc_trim`), which costs a walk of its free
//! lists: well under a millisecond for the agent's heap.

/// Returns free heap pages to the kernel (glibc); elsewhere nothing.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reads and updates the allocator's own state,
    // under its locks; any thread may call it.
    unsafe {
        libc::malloc_trim(0);
    }
}
