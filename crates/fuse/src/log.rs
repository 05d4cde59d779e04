//! Where the mount's messages go: stderr in the foreground; syslog once a daemon
//! has detached (its stderr then points nowhere, so that whoever started it, a shell
//! pipe or mount(8), is not kept waiting on it).

use std::sync::atomic::{AtomicBool, Ordering};

static SYSLOG: AtomicBool = AtomicBool::new(false);

/// Send messages to syslog (as `ubtrfs`, facility daemon) from now on.
pub fn to_syslog() {
    // SAFETY: the identifier is a static NUL-terminated string, as openlog keeps it.
    unsafe { libc::openlog(c"ubtrfs".as_ptr(), libc::LOG_PID, libc::LOG_DAEMON) };
    SYSLOG.store(true, Ordering::Release);
}

/// Report `msg` (one line, lowercase, naming the object).
pub fn log(msg: &str) {
    say(libc::LOG_WARNING, "", msg);
}

/// Report `msg` as an error: data was lost or refused (syslog's LOG_ERR).
pub fn log_error(msg: &str) {
    say(libc::LOG_ERR, "error: ", msg);
}

fn say(priority: libc::c_int, prefix: &str, msg: &str) {
    if SYSLOG.load(Ordering::Acquire) {
        let Ok(c) = std::ffi::CString::new(format!("{prefix}{msg}").replace('\0', "\\0")) else {
            return;
        };
        // SAFETY: "%s" with one NUL-terminated string argument.
        unsafe { libc::syslog(priority, c"%s".as_ptr(), c.as_ptr()) };
    } else {
        eprintln!("ubtrfs: {prefix}{msg}");
    }
}
