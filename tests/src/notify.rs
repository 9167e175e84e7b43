//! A `NOTIFY_SOCKET` stand-in: a unix datagram socket the harness binds and reads on a
//! thread, recording every `KEY=VALUE` line the daemon sends (as systemd would receive them).

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Default)]
struct Shared {
    lines: Mutex<Vec<String>>,
    changed: Condvar,
}

pub struct NotifyListener {
    path: PathBuf,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl NotifyListener {
    pub fn bind(path: &Path) -> NotifyListener {
        let sock = UnixDatagram::bind(path)
            .unwrap_or_else(|e| panic!("bind notify socket {}: {e}", path.display()));
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("set_read_timeout");
        let shared = Arc::new(Shared::default());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let shared = shared.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match sock.recv(&mut buf) {
                        Ok(n) => {
                            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                            let mut lines = shared.lines.lock().expect("notify lock");
                            lines.extend(
                                text.split('\n')
                                    .filter(|l| !l.is_empty())
                                    .map(str::to_owned),
                            );
                            shared.changed.notify_all();
                        }
                        Err(_) => {
                            if stop.load(Ordering::Relaxed) {
                                return;
                            }
                        }
                    }
                }
            })
        };
        NotifyListener {
            path: path.to_path_buf(),
            shared,
            stop,
            thread: Some(thread),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every line received so far, in order.
    pub fn lines(&self) -> Vec<String> {
        self.shared.lines.lock().expect("notify lock").clone()
    }

    /// Number of lines exactly equal to `line` received so far.
    pub fn count(&self, line: &str) -> usize {
        self.shared
            .lines
            .lock()
            .expect("notify lock")
            .iter()
            .filter(|l| l.as_str() == line)
            .count()
    }

    /// Waits (bounded) until a line equal to `line` appears at index `>= from`; returns its
    /// index, or `None` once `limit` passed or `give_up()` says to stop waiting.
    pub fn wait_for(
        &self,
        line: &str,
        from: usize,
        limit: Duration,
        mut give_up: impl FnMut() -> bool,
    ) -> Option<usize> {
        let deadline = Instant::now() + limit;
        let mut lines = self.shared.lines.lock().expect("notify lock");
        loop {
            if let Some(i) = lines.iter().skip(from).position(|l| l == line) {
                return Some(from + i);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let wait = (deadline - now).min(Duration::from_millis(20));
            lines = self
                .shared
                .changed
                .wait_timeout(lines, wait)
                .expect("notify lock")
                .0;
            if give_up() {
                // One last look: the line may have arrived with the exit.
                drop(lines);
                std::thread::sleep(Duration::from_millis(50));
                let lines = self.shared.lines.lock().expect("notify lock");
                return lines
                    .iter()
                    .skip(from)
                    .position(|l| l == line)
                    .map(|i| from + i);
            }
        }
    }
}

impl Drop for NotifyListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
