//! Process-hardening system calls no safe wrapper offers: dropping every capability,
//! closing the process's `/proc` files to its own user, and W^X memory that children do
//! not inherit. Each is one system call; nothing here allocates or keeps state.

use std::io;

fn check(ret: libc::c_long) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Gives up every capability — ambient, bounding (where this process may), effective,
/// permitted and inheritable — for this process and whatever it executes.
pub fn drop_capabilities() -> io::Result<()> {
    // Highest capability number a kernel may know; those it does not are EINVAL.
    const LAST_CAP: libc::c_ulong = 63;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    // SAFETY: prctl with integer arguments only.
    check(unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
        .into()
    })?;
    for cap in 0..=LAST_CAP {
        // Without CAP_SETPCAP (an unprivileged process) there is nothing to drop: the
        // bounding set only matters to one that holds capabilities.
        // SAFETY: prctl with integer arguments only.
        let _ = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    let header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let none = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset reads one version-3 header and the two data structs that version
    // takes, both alive for the call.
    check(unsafe { libc::syscall(libc::SYS_capset, &header, none.as_ptr()) })
}

/// Makes this process's `/proc` files (environment, memory, descriptors) root's, so other
/// processes of its user cannot read them (it can, as itself). No core dumps either.
pub fn not_dumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0).into() })
}

/// W^X for this process (memory never gains execute permission once writable), not
/// handed on to its children. Linux 6.6 and later; EINVAL before.
pub fn deny_write_execute_here() -> io::Result<()> {
    const PR_SET_MDWE: libc::c_int = 65;
    const PR_MDWE_REFUSE_EXEC_GAIN: libc::c_ulong = 1;
    const PR_MDWE_NO_INHERIT: libc::c_ulong = 2;
    // SAFETY: prctl with integer arguments only.
    check(unsafe {
        libc::prctl(
            PR_SET_MDWE,
            PR_MDWE_REFUSE_EXEC_GAIN | PR_MDWE_NO_INHERIT,
            0,
            0,
            0,
        )
        .into()
    })
}
