//! Process-hardening system calls no safe wrapper offers: dropping every capability,
//! closing the process's `/proc` files to its own user, W^X memory that children do not
//! inherit, and the system-call filter that marks a confined upstream; one question to a
//! socket (how much of what was written its peer has not taken); and giving back the
//! executable's pages that only start-up used. Each is one system call (the last one per
//! mapping, after reading `/proc/self/smaps` to prove it harmless) and keeps no state.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

fn check(ret: libc::c_long) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The bytes written to the stream socket `socket` that its peer has not acknowledged
/// yet, sent or not (`SIOCOUTQ`): it falls only as the peer takes data.
pub fn unsent_bytes(socket: BorrowedFd<'_>) -> io::Result<usize> {
    let mut queued: libc::c_int = 0;
    // SIOCOUTQ has the value of TIOCOUTQ on Linux; it writes one int.
    check(unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut queued) }.into())?;
    usize::try_from(queued).map_err(|_| io::Error::other("a negative send queue"))
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

/// Turns glibc's fast bins off for this process: small blocks freed go to the per-thread
/// cache, then straight to the ordinary bins. With fast bins, every allocation of 1 KiB
/// or more first consolidates them (`malloc_consolidate`) — once a request on a server
/// whose connection buffers are that size.
pub fn no_fast_bins() {
    // SAFETY: mallopt with integer arguments only, before any other thread exists.
    unsafe { libc::mallopt(libc::M_MXFAST, 0) };
}

/// Unmaps the resident pages of this process's own executable that hold exactly the
/// file's bytes (`MADV_DONTNEED` on its mappings without write permission and without an
/// anonymous page — never the relocated read-only data, whose pages are the process's own
/// copies), so they stop counting as its resident memory: the page cache keeps them, and
/// one is mapped again, unchanged, when next touched. The bytes of address space so
/// advised. Reads `/proc/self/smaps` to know which mappings qualify.
pub fn unmap_clean_own_code() -> io::Result<usize> {
    use std::os::unix::fs::MetadataExt;
    let exe = std::fs::metadata("/proc/self/exe")?;
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut advised = 0;
    for (start, end) in clean_read_only(&smaps, exe.dev(), exe.ino()) {
        // SAFETY: the range is a private mapping of the executable that cannot be written
        // and has no page of its own (`Anonymous: 0 kB`), so every page dropped is read back
        // from the file identical. Nothing in this process gains write permission to its
        // own executable's mappings afterwards.
        let ret =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        if ret == 0 {
            advised += end - start;
        }
    }
    Ok(advised)
}

/// The address ranges in `smaps` (the text of `/proc/<pid>/smaps`) of the file `dev`
/// `inode` that are mapped without write permission and hold no anonymous page.
fn clean_read_only(smaps: &str, dev: u64, inode: u64) -> Vec<(usize, usize)> {
    let device = format!("{:02x}:{:02x}", libc::major(dev), libc::minor(dev));
    let mut ranges = Vec::new();
    // The mapping whose fields are being read: its range, if it is one of the file's
    // read-only ones.
    let mut current: Option<(usize, usize)> = None;
    for line in smaps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(first) = fields.next() else {
            continue;
        };
        if first == "Anonymous:" {
            if let Some(range) = current.take()
                && fields.next() == Some("0")
            {
                ranges.push(range);
            }
            continue;
        }
        // A mapping's header: start-end perms offset dev inode [path].
        let Some((start, end)) = first.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(end, 16),
        ) else {
            continue;
        };
        let (perms, _offset, dev, ino) =
            (fields.next(), fields.next(), fields.next(), fields.next());
        current = (perms.is_some_and(|p| p.as_bytes().get(1) == Some(&b'-'))
            && dev == Some(device.as_str())
            && ino.and_then(|i| i.parse::<u64>().ok()) == Some(inode)
            && start < end)
            .then_some((start, end));
    }
    ranges
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

/// What the confined upstream's system-call filter refuses, beyond what Landlock governs
/// (`confine_system_calls`).
#[derive(Debug, Clone, Copy)]
pub struct Refusals {
    /// `network = "none"`: no socket but unix ones (no IPv4 or IPv6 socket at all —
    /// UDP, MPTCP, TCP Fast Open — nor netlink, packet or any other family).
    pub non_unix_sockets: bool,
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH_NATIVE: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH_NATIVE: u32 = 0xC000_00B7;

/// Numbers the libc crate may not know yet (the same on every architecture).
const NR_SETXATTRAT: i64 = 463;
const NR_REMOVEXATTRAT: i64 = 466;

/// One more system-call filter on this process and whatever it executes, which refuses:
/// another architecture's calls (ENOSYS); `io_uring_setup` (ENOSYS: a ring performs
/// operations outside the calls filters see); `clone3` (ENOSYS, so libc falls back to
/// `clone`: its `CLONE_INTO_CGROUP` places the child in any cgroup whose directory the
/// process can open, which Landlock does not govern); changing another process's limits,
/// I/O priority, scheduling or CPUs (`prlimit64`, `ioprio_set`, `sched_setscheduler`,
/// `sched_setparam`, `sched_setattr`, `sched_setaffinity` on a pid other than 0, and
/// `setpriority` on anything but the process itself: EPERM — a process of the daemon's
/// user could otherwise make the daemon idle); the kernel's keyrings (`add_key`,
/// `request_key`, `keyctl`: EPERM — they are the user's, shared with the daemon and
/// every other upstream); changing a file's
/// mode, owner, times or extended attributes by path (EPERM: Landlock does not govern
/// metadata, and a path can name a file the process may not open — by descriptor it
/// stays possible on files it opened); with `non_unix_sockets`, every socket but a
/// unix one (EACCES). Filters only add up, so the count in `/proc/<pid>/status`
/// (`Seccomp_filters`) marks the process, and all it starts, as one more filtered than
/// its parent. Needs no-new-privileges (or CAP_SYS_ADMIN).
pub fn confine_system_calls(refuse: Refusals) -> io::Result<()> {
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const ALLOW: u32 = 0x7fff_0000;
    const ERRNO: u32 = 0x0005_0000;
    // Offsets in `struct seccomp_data`: nr, arch, then the arguments (low word first).
    const NR: u32 = 0;
    const ARCH: u32 = 4;
    const fn arg_low(n: u32) -> u32 {
        16 + 8 * n
    }
    let op = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let nr = |n: i64| n as u32;
    let errno = |e: i32| ERRNO | e as u32;
    let mut p = vec![
        op(LD_W_ABS, 0, 0, ARCH),
        op(JEQ_K, 1, 0, AUDIT_ARCH_NATIVE),
        op(RET_K, 0, 0, errno(libc::ENOSYS)),
        op(LD_W_ABS, 0, 0, NR),
    ];
    let deny = |p: &mut Vec<libc::sock_filter>, n: i64, e: i32| {
        p.push(op(JEQ_K, 0, 1, nr(n)));
        p.push(op(RET_K, 0, 0, errno(e)));
    };
    // Allowed when argument `arg` is 0 (this process itself; a null pointer).
    let unless_zero = |p: &mut Vec<libc::sock_filter>, n: i64, arg: u32, pointer: bool, e: i32| {
        if pointer {
            p.push(op(JEQ_K, 0, 6, nr(n)));
            p.push(op(LD_W_ABS, 0, 0, arg_low(arg)));
            p.push(op(JEQ_K, 0, 3, 0));
            p.push(op(LD_W_ABS, 0, 0, arg_low(arg) + 4));
            p.push(op(JEQ_K, 0, 1, 0));
        } else {
            p.push(op(JEQ_K, 0, 4, nr(n)));
            p.push(op(LD_W_ABS, 0, 0, arg_low(arg)));
            p.push(op(JEQ_K, 0, 1, 0));
        }
        p.push(op(RET_K, 0, 0, ALLOW));
        p.push(op(RET_K, 0, 0, errno(e)));
    };
    deny(&mut p, libc::SYS_io_uring_setup, libc::ENOSYS);
    deny(&mut p, libc::SYS_clone3, libc::ENOSYS);
    unless_zero(&mut p, libc::SYS_prlimit64, 0, false, libc::EPERM);
    unless_zero(&mut p, libc::SYS_ioprio_set, 1, false, libc::EPERM);
    for n in [
        libc::SYS_sched_setscheduler,
        libc::SYS_sched_setparam,
        libc::SYS_sched_setattr,
        libc::SYS_sched_setaffinity,
    ] {
        unless_zero(&mut p, n, 0, false, libc::EPERM);
    }
    // setpriority(which, who, prio): only PRIO_PROCESS (0) of itself (0).
    p.push(op(JEQ_K, 0, 6, nr(libc::SYS_setpriority)));
    p.push(op(LD_W_ABS, 0, 0, arg_low(0)));
    p.push(op(JEQ_K, 0, 3, 0));
    p.push(op(LD_W_ABS, 0, 0, arg_low(1)));
    p.push(op(JEQ_K, 0, 1, 0));
    p.push(op(RET_K, 0, 0, ALLOW));
    p.push(op(RET_K, 0, 0, errno(libc::EPERM)));
    for n in [libc::SYS_add_key, libc::SYS_request_key, libc::SYS_keyctl] {
        deny(&mut p, n, libc::EPERM);
    }
    unless_zero(&mut p, libc::SYS_utimensat, 1, true, libc::EPERM);
    let by_path = [
        libc::SYS_fchmodat,
        libc::SYS_fchmodat2,
        libc::SYS_fchownat,
        libc::SYS_setxattr,
        libc::SYS_lsetxattr,
        libc::SYS_removexattr,
        libc::SYS_lremovexattr,
        NR_SETXATTRAT,
        NR_REMOVEXATTRAT,
    ];
    #[cfg(target_arch = "x86_64")]
    let by_path = [
        &by_path[..],
        &[
            libc::SYS_chmod,
            libc::SYS_chown,
            libc::SYS_lchown,
            libc::SYS_utime,
            libc::SYS_utimes,
            libc::SYS_futimesat,
        ],
    ]
    .concat();
    for n in by_path {
        deny(&mut p, n, libc::EPERM);
    }
    if refuse.non_unix_sockets {
        p.push(op(JEQ_K, 0, 4, nr(libc::SYS_socket)));
        p.push(op(LD_W_ABS, 0, 0, arg_low(0)));
        p.push(op(JEQ_K, 1, 0, libc::AF_UNIX as u32));
        p.push(op(RET_K, 0, 0, errno(libc::EACCES)));
        p.push(op(RET_K, 0, 0, ALLOW));
    }
    p.push(op(RET_K, 0, 0, ALLOW));
    let prog = libc::sock_fprog {
        len: u16::try_from(p.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        filter: p.as_mut_ptr(),
    };
    // SAFETY: the program and its header live across the call; the kernel copies them.
    check(unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &prog as *const libc::sock_fprog,
            0,
            0,
        )
        .into()
    })
}

/// How many system-call filters process `pid` (a number, or `self`) runs under:
/// `Seccomp_filters` in its `/proc` status; none when it cannot be read or the process
/// has exited (a zombie is no longer what it was).
pub fn seccomp_filters(pid: &str) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    if field("State:").is_none_or(|state| state.starts_with(['Z', 'X'])) {
        return None;
    }
    field("Seccomp_filters:").and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    use super::{clean_read_only, unmap_clean_own_code, unsent_bytes};

    #[test]
    fn only_the_executables_read_only_mappings_without_a_page_of_their_own() {
        let smaps = "\
55d0c0000000-55d0c0100000 r--p 00000000 fd:01 1234 /usr/bin/robota-mcpd
Rss:                 100 kB
Anonymous:             0 kB
55d0c0100000-55d0c0900000 r-xp 00100000 fd:01 1234 /usr/bin/robota-mcpd
Rss:                8000 kB
Anonymous:             0 kB
55d0c0900000-55d0c0a00000 r--p 00900000 fd:01 1234 /usr/bin/robota-mcpd
Anonymous:           120 kB
55d0c0a00000-55d0c0a10000 rw-p 00a00000 fd:01 1234 /usr/bin/robota-mcpd
Anonymous:             0 kB
55d0c1000000-55d0c1200000 rw-p 00000000 00:00 0 [heap]
Anonymous:          2048 kB
7f0000000000-7f0000100000 r-xp 00000000 fd:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
Anonymous:             0 kB
7f0000200000-7f0000300000 r-xp 00000000 fd:02 1234 /mnt/other/same-inode
Anonymous:             0 kB
7f0000400000-7f0000500000 r-xp 00000000 fd:01 1234 /usr/bin/robota-mcpd (deleted)
Anonymous:             0 kB
7f0000600000-7f0000700000 r-xp 00000000 fd:01 1234 /usr/bin/robota-mcpd
garbage line
";
        // fd:01 is major 253, minor 1.
        let dev = libc::makedev(0xfd, 0x01);
        assert_eq!(
            clean_read_only(smaps, dev, 1234),
            vec![
                (0x55d0c0000000, 0x55d0c0100000),
                (0x55d0c0100000, 0x55d0c0900000),
                (0x7f0000400000, 0x7f0000500000),
            ],
            "not the relocated data (a page of its own), not writable, not another file, \
             not one whose Anonymous line is missing"
        );
    }

    /// The kB of `field` in `/proc/self/status`.
    fn status_kib(field: &str) -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect(field)
    }

    #[test]
    fn the_executables_clean_pages_leave_the_resident_set_and_it_runs_on() {
        let before = status_kib("RssFile:");
        let advised = unmap_clean_own_code().expect("unmapped");
        let after = status_kib("RssFile:");
        assert!(advised > 0, "nothing advised");
        assert!(after < before, "RssFile {before} → {after} kB");
        // Code, read-only data, unwind tables and the relocated tables all still work:
        // formatting through trait objects, a panic caught and its message read.
        let shown: Vec<Box<dyn std::fmt::Display>> = vec![Box::new(7u8), Box::new("x")];
        assert_eq!(format!("{}{}", shown[0], shown[1]), "7x");
        let caught = std::panic::catch_unwind(|| panic!("still unwinding"));
        let message = caught.expect_err("panicked");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"still unwinding"));
    }

    #[test]
    fn the_send_queue_holds_what_the_peer_has_not_taken() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut ours = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (mut theirs, _) = listener.accept().expect("accept");
        assert_eq!(unsent_bytes(ours.as_fd()).expect("ioctl"), 0);
        // Written until the kernel takes no more: the peer's window is full, the rest
        // waits in our queue.
        ours.set_nonblocking(true).expect("nonblocking");
        let mut written = 0usize;
        while written < 256 << 20 {
            match ours.write(&[7; 65536]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        let queued = unsent_bytes(ours.as_fd()).expect("ioctl");
        assert!(queued > 0 && queued <= written, "{queued} of {written}");
        // The peer takes it all: the queue empties.
        let mut got = vec![0; written];
        theirs.read_exact(&mut got).expect("read");
        let deadline = Instant::now() + Duration::from_secs(5);
        while unsent_bytes(ours.as_fd()).expect("ioctl") != 0 {
            assert!(Instant::now() < deadline, "the queue never emptied");
            std::thread::yield_now();
        }
        // Not a socket: the kernel says so.
        let file = std::fs::File::open("/dev/null").expect("open");
        assert!(unsent_bytes(file.as_fd()).is_err());
    }
}
