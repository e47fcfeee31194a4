//! Wakes the CNI installer when the configuration directory changes
//! (inotify), so a conflist another installer rewrites gets ambpf's entry
//! back within moments rather than at the next poll, as Istio's installer
//! re-chains on a file-system event.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
    time::Duration,
};

use tokio::io::{Interest, unix::AsyncFd};

/// Changes to one directory's entries: files written, created, renamed in
/// or out, deleted.
pub struct DirChanges {
    fd: AsyncFd<OwnedFd>,
}

/// How long a burst of changes is let settle before the directory is read
/// (an installer's write, chmod and rename are one change).
const SETTLE: Duration = Duration::from_millis(200);

impl DirChanges {
    /// Watches `dir`. Needs a tokio runtime.
    pub fn new(dir: &Path) -> io::Result<Self> {
        let path = CString::new(dir.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: inotify_init1 takes flags only; a non-negative return is a
        // new descriptor that the OwnedFd owns from here on.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by inotify_init1 and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mask = libc::IN_CLOSE_WRITE
            | libc::IN_MOVED_TO
            | libc::IN_MOVED_FROM
            | libc::IN_CREATE
            | libc::IN_DELETE
            | libc::IN_MODIFY;
        // SAFETY: `path` is a NUL-terminated string that outlives the call.
        if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), mask) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the OwnedFd is a valid descriptor that the AsyncFd owns,
        // and so keeps open and unchanged, for its whole life.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(Self { fd })
    }

    /// Returns once something in the directory changed and the burst has
    /// settled; the events are consumed.
    pub async fn changed(&self) -> io::Result<()> {
        self.next_event().await?;
        tokio::time::sleep(SETTLE).await;
        // What came in meanwhile is the same change.
        while self.read_events()? {}
        Ok(())
    }

    async fn next_event(&self) -> io::Result<()> {
        loop {
            let mut ready = self.fd.readable().await?;
            if self.read_events()? {
                return Ok(());
            }
            ready.clear_ready();
        }
    }

    /// Reads what events are queued; whether there were any.
    fn read_events(&self) -> io::Result<bool> {
        let mut buf = [0u8; 4096];
        // SAFETY: reads at most `buf.len()` bytes into `buf`.
        let n = unsafe {
            libc::read(
                self.fd.get_ref().as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n >= 0 {
            return Ok(n > 0);
        }
        match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            e => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_file_replaced_in_the_directory_wakes_the_watch() {
        let dir = std::env::temp_dir().join(format!("ambpf-conf-watch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let changes = DirChanges::new(&dir).unwrap();
        // Nothing changed: no wake.
        let quiet = tokio::time::timeout(Duration::from_millis(300), changes.changed()).await;
        assert!(quiet.is_err(), "woke without a change");
        // Another installer's write-and-rename.
        std::fs::write(dir.join(".tmp"), b"{}").unwrap();
        std::fs::rename(dir.join(".tmp"), dir.join("10-net.conflist")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), changes.changed())
            .await
            .expect("woken by the rename")
            .unwrap();
        // The burst was consumed: no second wake for it.
        let quiet = tokio::time::timeout(Duration::from_millis(300), changes.changed()).await;
        assert!(quiet.is_err(), "woke twice for one change");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
