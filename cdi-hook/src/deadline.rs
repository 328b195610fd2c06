//! A bound on the whole hook: a watchdog thread ends the process (and the child it waits
//! for, ldconfig) once the deadline passes, so that nothing an image contains can hold up
//! the creation of its container forever. Every step also has its own bound (reads are of
//! regular files of bounded size, includes are bounded, ldconfig has a timeout); this is
//! the last line.

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

/// The hook's default deadline. The runtime may have its own (`hooks[].timeout`).
pub const DEFAULT: Duration = Duration::from_secs(60);

/// The child process the hook is waiting for (0: none).
static CHILD: AtomicI32 = AtomicI32::new(0);

/// Records the child to kill when the deadline passes (0 when there is none any more).
pub fn track_child(pid: u32) {
    CHILD.store(i32::try_from(pid).unwrap_or(0), Ordering::SeqCst);
}

/// Starts the watchdog: after `limit`, kill the tracked child, say why on stderr and exit 1.
pub fn start(limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        if let Some(pid) = rustix::process::Pid::from_raw(CHILD.load(Ordering::SeqCst)) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
        eprintln!(
            "cleave-cdi-hook: error: {}",
            crate::error::HookError::Deadline {
                secs: limit.as_secs()
            }
        );
        std::process::exit(1);
    });
}
