//! The agent's flight recorder: the store keeps the chunks of the last `--flight-recorder`
//! (within `--buffer-size`; beyond it the oldest are recycled and counted, as always), and a
//! dump writes a time range of them as a Gecko profile while sampling and the windows go on.
//!
//! Dumps are asked for over a local Unix socket (`rsprof-bpf dump`), mode 0600 in a 0700
//! directory, owned by root; the agent also checks each peer's credentials (SO_PEERCRED) and
//! refuses anyone but root, should the socket's mode have been loosened. SIGUSR1 dumps to
//! `--dump-dir` (files 0600). Nothing listens on the network.
//!
//! The profile is streamed to the client, which writes its file itself: the agent may run in
//! a sandbox that can write only its spool (systemd's `ProtectSystem=strict`), and a relative
//! `-o` means the client's directory, not the agent's. Protocol: the client sends one line
//! `dump LAST_MS` (0: all that is kept); the agent answers `ok LEN SAMPLES MARKERS` and LEN
//! bytes of gzip-compressed Gecko JSON, or `error MESSAGE`.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::{
        fs::{DirBuilderExt as _, FileTypeExt as _, PermissionsExt as _},
        io::AsRawFd as _,
        net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};
use flate2::{Compression, write::GzEncoder};

use crate::{
    export::{ExportJob, output::PendingOutput},
    session::{Recorder, Signals, messages::Messages, windows::Windows},
    symbolize::Service,
    writers::Format,
};

pub const DEFAULT_SOCKET: &str = "/run/rsprof-bpf/agent.sock";
/// A client has this long to send its request line.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Dumps captured but not yet written; more are refused ("busy") so memory stays bounded.
const QUEUED_DUMPS: usize = 1;

/// `--flight-recorder`, `--dump-socket`, `--dump-dir`, validated.
#[derive(Clone, Debug)]
pub struct FlightPlan {
    pub keep: Duration,
    pub socket: PathBuf,
    pub dump_dir: Option<PathBuf>,
}

impl FlightPlan {
    /// None without `--flight-recorder` (then the other two are refused).
    pub fn from_options(
        keep: Option<Duration>,
        socket: Option<PathBuf>,
        dump_dir: Option<PathBuf>,
    ) -> Result<Option<Self>> {
        let Some(keep) = keep else {
            if socket.is_some() || dump_dir.is_some() {
                bail!("dump-socket and dump-dir need flight-recorder (e.g. --flight-recorder 5m)");
            }
            return Ok(None);
        };
        if !(Duration::from_secs(1)..=Duration::from_secs(24 * 3600)).contains(&keep) {
            bail!("invalid flight-recorder {keep:?}: must be between 1s and 24h");
        }
        Ok(Some(Self { keep, socket: socket.unwrap_or_else(|| DEFAULT_SOCKET.into()), dump_dir }))
    }
}

/// Where a captured dump goes.
enum Dest {
    Client(UnixStream),
    Dir(PathBuf),
}

struct Dump {
    job: ExportJob,
    dest: Dest,
    captured: Instant,
}

/// The socket, its accepting thread and the thread writing dumps.
pub struct FlightServer {
    plan: FlightPlan,
    /// Accepted requests waiting for the sampling loop to capture their range.
    pending: Arc<Mutex<Vec<(Duration, UnixStream)>>>,
    dumps: mpsc::SyncSender<Dump>,
    msgs: Messages,
}

impl Drop for FlightServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.plan.socket);
    }
}

impl FlightServer {
    /// Binds the socket (root-only) and starts its threads; `wake` is notified for each
    /// request.
    pub fn start(
        plan: &FlightPlan,
        wake: Arc<tokio::sync::Notify>,
        symbolizer: Arc<Service>,
        msgs: Messages,
    ) -> Result<Self> {
        if let Some(dir) = &plan.dump_dir {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("create dump dir {}", dir.display()))?;
        }
        let listener = bind_private(&plan.socket)?;
        let pending = Arc::new(Mutex::new(Vec::new()));
        let p = pending.clone();
        std::thread::Builder::new()
            .name("flight-accept".into())
            .spawn(move || accept_loop(listener, p, wake, msgs))?;
        let (dumps, rx) = mpsc::sync_channel::<Dump>(QUEUED_DUMPS);
        std::thread::Builder::new().name("flight-dump".into()).spawn(move || {
            for d in rx {
                write_dump(d, &symbolizer, msgs);
            }
        })?;
        msgs.info(format_args!(
            "flight recorder: the last {} kept; dumps on {}{}",
            humantime::format_duration(plan.keep),
            plan.socket.display(),
            match &plan.dump_dir {
                Some(d) => format!(" and, on SIGUSR1, to {}", d.display()),
                None => String::new(),
            }
        ));
        Ok(Self { plan: plan.clone(), pending, dumps, msgs })
    }

    /// Captures what was asked for since the last call (cheap: a copy of the chunks) and
    /// hands it to the dump thread.
    fn serve(&self, recorder: &mut Recorder, windows: &Windows) {
        let requests = std::mem::take(&mut *self.pending.lock().unwrap());
        for (last, stream) in requests {
            let last = if last.is_zero() { self.plan.keep } else { last.min(self.plan.keep) };
            self.queue(windows.recent(recorder, last), Dest::Client(stream));
        }
        if recorder.take_usr1() {
            match &self.plan.dump_dir {
                Some(dir) => {
                    let path = dir.join(dump_name(SystemTime::now()));
                    self.queue(windows.recent(recorder, self.plan.keep), Dest::Dir(path));
                }
                None => self.msgs.warn("SIGUSR1: no --dump-dir to write the flight recorder to"),
            }
        }
    }

    fn queue(&self, job: ExportJob, dest: Dest) {
        match self.dumps.try_send(Dump { job, dest, captured: Instant::now() }) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(d) | mpsc::TrySendError::Disconnected(d)) => {
                let why = "busy: another dump is being written; try again";
                match d.dest {
                    Dest::Client(mut s) => {
                        let _ = writeln!(s, "error {why}");
                    }
                    Dest::Dir(p) => {
                        self.msgs.warn(format_args!("SIGUSR1 dump {} skipped: {why}", p.display()))
                    }
                }
            }
        }
    }
}

/// Samples until `until` or a stop (returned), serving dumps meanwhile. SIGUSR1 without a
/// flight recorder is reported and otherwise ignored.
pub fn run_window(
    rt: &tokio::runtime::Runtime,
    recorder: &mut Recorder,
    windows: &Windows,
    signals: &mut Signals,
    until: tokio::time::Instant,
    flight: Option<&FlightServer>,
    msgs: Messages,
) -> Result<Option<String>> {
    loop {
        let stop = rt.block_on(recorder.run_until(signals, Some(until)))?;
        match flight {
            Some(f) => f.serve(recorder, windows),
            None if recorder.take_usr1() => {
                msgs.warn("SIGUSR1 ignored: the agent runs without --flight-recorder")
            }
            None => {}
        }
        if stop.is_some() || tokio::time::Instant::now() >= until {
            return Ok(stop);
        }
    }
}

/// `flight-20260102T030405.678Z.json.gz`: UTC, sorts by time.
fn dump_name(t: SystemTime) -> String {
    let stamp = humantime::format_rfc3339_millis(t).to_string().replace([':', '-'], "");
    format!("flight-{stamp}.json.gz")
}

/// A listening socket at `path` only root can use: its directory is created 0700, the
/// socket made 0600 (the umask is tightened around `bind` so it is never wider). A stale
/// socket left by a killed agent is replaced; a live one is an error.
fn bind_private(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("create {}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!("dump socket {} exists and is not a socket", path.display());
        }
        if UnixStream::connect(path).is_ok() {
            bail!("dump socket {} is in use: another agent is running", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("remove stale {}", path.display()))?;
    }
    // SAFETY: umask has no preconditions; restored right after.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let listener = bound.with_context(|| format!("bind dump socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// The uid of the process at the other end of `s` (SO_PEERCRED: as it was at connect).
pub fn peer_uid(s: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for getsockopt to write.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

fn accept_loop(
    listener: UnixListener,
    pending: Arc<Mutex<Vec<(Duration, UnixStream)>>>,
    wake: Arc<tokio::sync::Notify>,
    msgs: Messages,
) {
    for conn in listener.incoming() {
        let mut s = match conn {
            Ok(s) => s,
            Err(e) => {
                msgs.warn(format_args!("dump socket: accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        match peer_uid(&s) {
            Ok(0) => {}
            Ok(uid) => {
                msgs.warn(format_args!("dump socket: refused uid {uid} (only root may dump)"));
                let _ = writeln!(s, "error refused: uid {uid} is not root; only root may dump");
                continue;
            }
            Err(e) => {
                msgs.warn(format_args!("dump socket: peer credentials: {e}"));
                continue;
            }
        }
        match read_request(&s) {
            Ok(last) => {
                pending.lock().unwrap().push((last, s));
                wake.notify_one();
            }
            Err(e) => {
                let _ = writeln!(s, "error {e:#}");
            }
        }
    }
}

/// `dump LAST_MS`.
fn read_request(s: &UnixStream) -> Result<Duration> {
    s.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new(s.take(128)).read_line(&mut line).context("read request")?;
    let ms =
        line.trim_end().strip_prefix("dump ").and_then(|n| n.parse::<u64>().ok()).with_context(
            || format!("bad request {:?}: expected `dump LAST_MS`", line.trim_end()),
        )?;
    Ok(Duration::from_millis(ms))
}

const EMPTY_NOTE: &str = "Nothing recorded in the flight recorder's range";

fn write_dump(d: Dump, symbolizer: &Service, msgs: Messages) {
    let secs = d.job.info.end.secs_since(d.job.info.start);
    match d.dest {
        Dest::Client(mut s) => {
            let mut gz = GzEncoder::new(Vec::new(), Compression::fast());
            let res = d
                .job
                .write_to(&mut gz, Format::Gecko, EMPTY_NOTE, Some(symbolizer))
                .and_then(|w| Ok((w, gz.finish()?)));
            let sent = match res {
                Ok((w, bytes)) => {
                    let head =
                        format!("ok {} {} {}\n", bytes.len(), w.stats.samples, w.stats.markers);
                    let r = s.write_all(head.as_bytes()).and_then(|_| s.write_all(&bytes));
                    r.map(|_| (w.stats.samples, w.stats.markers, bytes.len()))
                        .map_err(anyhow::Error::from)
                }
                Err(e) => {
                    let _ = writeln!(s, "error {}", format!("{e:#}").replace('\n', " "));
                    Err(e)
                }
            };
            match sent {
                Ok((samples, markers, bytes)) => msgs.info(format_args!(
                    "flight recorder: sent the last {secs:.1} s ({samples} samples, {markers} \
                     markers, {bytes} bytes) in {:.0} ms",
                    d.captured.elapsed().as_secs_f64() * 1e3
                )),
                Err(e) => msgs.warn(format_args!("flight recorder dump failed: {e:#}")),
            }
        }
        Dest::Dir(path) => {
            let res = PendingOutput::create_file(&path, 0o600)
                .and_then(|o| d.job.write_with(o, Format::Gecko, EMPTY_NOTE, Some(symbolizer)));
            match res {
                Ok(w) => msgs.info(format_args!(
                    "flight recorder: wrote {} (the last {secs:.1} s, {} samples, {} markers) in \
                     {:.0} ms",
                    path.display(),
                    w.stats.samples,
                    w.stats.markers,
                    d.captured.elapsed().as_secs_f64() * 1e3
                )),
                Err(e) => {
                    msgs.warn(format_args!("flight recorder: {} failed: {e:#}", path.display()))
                }
            }
        }
    }
}

/// `rsprof-bpf dump`'s side: asks the agent at `socket` for the last `last` (None: all it
/// keeps); returns the gzip-compressed Gecko JSON and the sample and marker counts.
pub fn request(socket: &Path, last: Option<Duration>) -> Result<(Vec<u8>, u64, u64)> {
    let mut s = UnixStream::connect(socket).map_err(|e| match e.kind() {
        std::io::ErrorKind::PermissionDenied => anyhow::anyhow!(
            "cannot connect to the agent's dump socket {}: permission denied (only root may \
             dump the flight recorder)",
            socket.display()
        ),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => anyhow::anyhow!(
            "no agent is serving dumps at {} ({e}): is `rsprof-bpf agent --flight-recorder` \
             running?",
            socket.display()
        ),
        _ => anyhow::anyhow!("connect to {}: {e}", socket.display()),
    })?;
    // A refusal may already be waiting (then this write can fail): the answer says why.
    let _ = writeln!(s, "dump {}", last.map_or(0, |d| d.as_millis().max(1)));
    let mut r = BufReader::new(s);
    let mut head = String::new();
    r.read_line(&mut head).context("read the agent's answer")?;
    let head = head.trim_end();
    if let Some(msg) = head.strip_prefix("error ") {
        bail!("the agent refused the dump: {msg}");
    }
    let fields: Vec<u64> = (head.strip_prefix("ok "))
        .map(|h| h.split(' ').filter_map(|f| f.parse().ok()).collect())
        .unwrap_or_default();
    let [len, samples, markers] = fields[..] else {
        bail!("unexpected answer from the agent: {head:?}");
    };
    let mut body = Vec::with_capacity(len as usize);
    r.take(len).read_to_end(&mut body).context("read the profile")?;
    if body.len() as u64 != len {
        bail!("the agent's answer ended after {} of {len} bytes", body.len());
    }
    Ok((body, samples, markers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_names() {
        assert!(FlightPlan::from_options(None, None, None).unwrap().is_none());
        let five = Some(Duration::from_secs(300));
        let p = FlightPlan::from_options(five, None, Some("/d".into())).unwrap().unwrap();
        assert_eq!((p.keep, p.socket.to_str()), (Duration::from_secs(300), Some(DEFAULT_SOCKET)));
        for bad in [Duration::ZERO, Duration::from_secs(2 * 24 * 3600)] {
            assert!(FlightPlan::from_options(Some(bad), None, None).is_err(), "{bad:?}");
        }
        assert!(FlightPlan::from_options(None, None, Some("/d".into())).is_err());
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_767_323_045_678);
        assert_eq!(dump_name(t), "flight-20260102T030405.678Z.json.gz");
    }
}
