//! `rsprof-bpf agent --pyroscope`: windows pushed to a loopback HTTP receiver written here
//! (no Pyroscope server is reachable), whose requests are decoded by `protoc` from the
//! published message definitions (not our structs) and whose pprof payloads are read by Go's
//! pprof. Reliability: a receiver down at start, one rejecting everything, an agent killed
//! while it is down. Needs root and protoc (`cargo xtask setup`).

use std::{
    collections::{HashMap, HashSet},
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU16, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use tests::{
    agent::{Agent, spool_dir},
    fixtures,
    go_pprof::{self, parse_top},
    harness::{Background, output_path},
};

/// One HTTP request the receiver got.
#[derive(Clone, Debug)]
struct Request {
    path: String,
    /// Lower-case names.
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

/// A loopback HTTP/1.1 server recording requests and answering with `status`.
struct Receiver {
    port: u16,
    requests: Arc<Mutex<Vec<Request>>>,
    status: Arc<AtomicU16>,
    stop: Arc<AtomicBool>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

impl Receiver {
    /// Listens on `port` (0: any).
    fn start(port: u16, status: u16) -> Receiver {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind receiver");
        let port = listener.local_addr().unwrap().port();
        let r = Receiver {
            port,
            requests: Default::default(),
            status: Arc::new(AtomicU16::new(status)),
            stop: Default::default(),
        };
        let (requests, status, stop) = (r.requests.clone(), r.status.clone(), r.stop.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (requests, status) = (requests.clone(), status.clone());
                thread::spawn(move || serve(conn, &requests, &status));
            }
        });
        r
    }

    fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }
}

/// Serves one keep-alive connection.
fn serve(conn: TcpStream, requests: &Mutex<Vec<Request>>, status: &AtomicU16) {
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or_default().to_owned();
        let mut headers = HashMap::new();
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
            }
        }
        let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        requests.lock().unwrap().push(Request { path, headers, body });
        let answer = match status.load(Ordering::SeqCst) {
            200 => {
                "HTTP/1.1 200 OK\r\nContent-Type: application/proto\r\nContent-Length: 0\r\n\r\n"
                    .to_owned()
            }
            code => {
                let msg = r#"{"code":"invalid_argument","message":"receiver says no: bad labels"}"#;
                format!(
                    "HTTP/1.1 {code} Refused\r\nContent-Type: application/json\r\nContent-Length: \
                     {}\r\n\r\n{msg}",
                    msg.len()
                )
            }
        };
        if out.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// A port nothing listens on (bound, then closed).
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The published push.v1/types.v1 messages the requests are decoded with.
const PUSH_PROTO: &str = r#"syntax = "proto3";
package push.v1;
message LabelPair { string name = 1; string value = 2; }
message RawSample { bytes raw_profile = 1; string ID = 2; }
message RawProfileSeries { repeated LabelPair labels = 1; repeated RawSample samples = 2; }
message PushRequest { repeated RawProfileSeries series = 1; }
"#;

/// One decoded window: its series labels, id and gzipped pprof.
#[derive(Debug)]
struct Pushed {
    labels: HashMap<String, String>,
    id: String,
    profile: Vec<u8>,
}

fn protoc(args: &[&str], input: &[u8]) -> String {
    let mut child = Command::new("protoc")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("protoc (Debian protobuf-compiler) is needed: run `cargo xtask setup`");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "protoc {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Decodes a push body with `protoc --decode`: its windows, one series of one sample each.
fn decode_push(body: &[u8]) -> Vec<Pushed> {
    let dir = output_path("agent_push_proto", "d");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("push.proto"), PUSH_PROTO).unwrap();
    let text =
        protoc(&["--decode=push.v1.PushRequest", "-I", dir.to_str().unwrap(), "push.proto"], body);
    let mut out = Vec::new();
    let mut name = None;
    for line in text.lines().map(str::trim) {
        if line == "series {" {
            out.push(Pushed { labels: HashMap::new(), id: String::new(), profile: Vec::new() });
            continue;
        }
        if line == "samples {" {
            let p = out.last().expect("samples inside a series");
            assert!(p.id.is_empty() && p.profile.is_empty(), "one sample per series:\n{text}");
        }
        let Some((key, value)) = line.split_once(": ") else { continue };
        let p = out.last_mut().unwrap_or_else(|| panic!("field outside a series:\n{text}"));
        let value = unescape(value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap());
        match key {
            "name" => name = Some(String::from_utf8(value).expect("UTF-8 label name")),
            "value" => {
                let n = name.take().expect("name before value");
                let v = String::from_utf8(value).expect("label values are UTF-8");
                assert!(p.labels.insert(n.clone(), v).is_none(), "label {n} twice");
            }
            "raw_profile" => p.profile = value,
            "ID" => p.id = String::from_utf8(value).unwrap(),
            _ => panic!("unexpected field {key} in:\n{text}"),
        }
    }
    assert!(!out.is_empty(), "a push without windows:\n{text}");
    out
}

/// Undoes protoc's text-format string escaping (C escapes, octal and hex bytes).
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' {
            out.push(b[i]);
            i += 1;
            continue;
        }
        i += 1;
        match b[i] {
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'x' => {
                let n = b[i + 1..].iter().take(2).take_while(|c| c.is_ascii_hexdigit()).count();
                out.push(u8::from_str_radix(&s[i + 1..i + 1 + n], 16).unwrap());
                i += n;
            }
            b'0'..=b'7' => {
                let n = b[i..].iter().take(3).take_while(|c| (b'0'..=b'7').contains(c)).count();
                out.push(u8::from_str_radix(&s[i..i + n], 8).unwrap());
                i += n - 1;
            }
            c => out.push(c),
        }
        i += 1;
    }
    out
}

/// The pprof `time_nanos` (field 9) of a gzipped profile, by `protoc --decode_raw`.
fn time_ms(profile_gz: &[u8]) -> u64 {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(profile_gz).read_to_end(&mut raw).unwrap();
    let text = protoc(&["--decode_raw"], &raw);
    let ns: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("9: ")?.parse().ok())
        .unwrap_or_else(|| panic!("no time_nanos:\n{text}"));
    ns / 1_000_000
}

fn names_in(dir: &Path) -> Vec<String> {
    match fs::read_dir(dir) {
        Ok(rd) => rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => Vec::new(),
    }
}

fn count_suffix(dir: &Path, suffix: &str) -> usize {
    names_in(dir).iter().filter(|n| n.ends_with(suffix)).count()
}

/// Checks each push's HTTP framing and decodes it: the windows of each request.
fn decode_requests(reqs: &[Request]) -> Vec<Vec<Pushed>> {
    reqs.iter()
        .map(|r| {
            assert_eq!(r.path, "/push.v1.PusherService/Push");
            assert_eq!(r.headers["content-type"], "application/proto");
            assert_eq!(r.headers["connect-protocol-version"], "1");
            decode_push(&r.body)
        })
        .collect()
}

/// Every window pushed; panics on a window pushed twice.
fn decode_all(reqs: &[Request]) -> Vec<Pushed> {
    let pushed: Vec<Pushed> = decode_requests(reqs).into_iter().flatten().collect();
    let mut ids = HashSet::new();
    for p in &pushed {
        assert!(ids.insert(p.id.clone()), "window {} pushed twice ({:?})", p.id, p.labels);
    }
    pushed
}

/// The summary line of sink pyroscope: (delivered, rejected, dropped).
fn sink_counts(stderr: &str) -> (u64, u64, u64) {
    let n = sink_numbers(stderr);
    (n("windows delivered"), n("rejected"), n("dropped"))
}

/// A number of the summary line of sink pyroscope, by the words after it.
fn sink_numbers(stderr: &str) -> impl Fn(&str) -> u64 + use<> {
    let line = stderr
        .lines()
        .find(|l| l.contains("sink pyroscope: "))
        .unwrap_or_else(|| panic!("no pyroscope summary:\n{stderr}"));
    let line = line.to_owned();
    move |after: &str| -> u64 {
        let before = line.split(&format!(" {after}")).next().unwrap();
        before.rsplit([' ', ':']).next().unwrap().parse().unwrap()
    }
}

#[test]
fn agent_pushes_to_pyroscope_with_labels_auth_and_backlog_once() {
    let dir = spool_dir("agent_push");
    let d = dir.to_str().unwrap();
    let secrets = output_path("agent_push_secrets", "d");
    fs::create_dir_all(&secrets).unwrap();
    fs::write(secrets.join("basic"), "it-user:s3cret:x\n").unwrap();
    fs::write(secrets.join("tenant"), "team-a\n").unwrap();
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}");
    let basic = secrets.join("basic");
    let tenant = secrets.join("tenant");
    let mut agent = Agent::start(&[
        "--spool",
        d,
        "--pyroscope",
        &url,
        "--pyroscope-basic-auth-file",
        basic.to_str().unwrap(),
        "--pyroscope-tenant-file",
        tenant.to_str().unwrap(),
        "--window",
        "2",
        "-F",
        "499",
        "--host",
        "it-host",
    ]);
    // The receiver is down for the fixture's run (about 2 windows): its windows are spooled.
    let name: &[u8] = b"q\"u\nx\xffz";
    let exe = fixtures::build("renamed").expect("build renamed");
    let status = Command::new(&exe)
        .arg(std::ffi::OsStr::from_bytes(name))
        .arg("4")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = status.id();
    let mut child = status;
    assert!(child.wait().unwrap().success());
    agent.wait_for("delivery failed, windows wait in the spool", Duration::from_secs(30));
    agent.wait_for("window:", Duration::from_secs(30));
    // Windows (one per service and window) spooled during the outage, at least.
    let backlog = count_suffix(&dir, ".json");
    let receiver = Receiver::start(port, 200);
    // The backlog is delivered (backoff is at most 60 s): every window marked as sent.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (windows, sent) = (count_suffix(&dir, ".json"), count_suffix(&dir, ".sent-pyroscope"));
        if windows > 0 && windows == sent {
            break;
        }
        assert!(Instant::now() < deadline, "{sent} of {windows} windows sent after 2 minutes");
        thread::sleep(Duration::from_millis(200));
    }
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("pyroscope: delivering again after"), "{stderr}");

    // Every spooled window arrived, once (the last one within the exit budget), the backlog
    // batched: the forwarder retries the batch it held when the outage began, then takes what
    // waited since, up to 64 windows a request; so the backlog is in the first
    // 1 + backlog/64 (rounded up) requests.
    let reqs = receiver.requests();
    let per_request: Vec<usize> = decode_requests(&reqs).iter().map(Vec::len).collect();
    let pushed = decode_all(&reqs);
    assert!(backlog >= 2, "the outage spooled windows: {backlog}");
    let first = 1 + backlog.div_ceil(64);
    let in_first: usize = per_request.iter().take(first).sum();
    assert!(in_first >= backlog, "{backlog} waited: {per_request:?}");
    assert!(reqs.len() < pushed.len(), "{} windows in {per_request:?}", pushed.len());
    let spooled = count_suffix(&dir, ".json");
    assert_eq!(pushed.len(), spooled, "each of the {spooled} spooled windows pushed once");
    assert_eq!(count_suffix(&dir, ".sent-pyroscope"), spooled, "{stderr}");
    let (delivered, rejected, dropped) = sink_counts(&stderr);
    assert_eq!((delivered, rejected, dropped), (spooled as u64, 0, 0), "{stderr}");
    for r in &reqs {
        assert_eq!(r.headers["authorization"], "Basic aXQtdXNlcjpzM2NyZXQ6eA==");
        assert_eq!(r.headers["x-scope-orgid"], "team-a");
    }

    // The fixture's windows (its service: its name, being in no unit or container): labels
    // by Pyroscope's rules, its odd name intact as UTF-8. A series per service, not per
    // process: no pid or process label; the samples carry the pid.
    let want_name = String::from_utf8_lossy(name).into_owned();
    let mine: Vec<&Pushed> =
        pushed.iter().filter(|p| p.labels.get("service_name") == Some(&want_name)).collect();
    assert!(mine.len() >= 2, "4 s in 2 s windows: {} pushed", mine.len());
    let mut pid_label = false;
    for p in &mine {
        let l = &p.labels;
        assert_eq!(l["__name__"], "process_cpu");
        assert_eq!(l["host"], "it-host");
        assert!(!l.contains_key("pid") && !l.contains_key("process"), "{l:?}");
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(p.profile.as_slice()).read_to_end(&mut raw).unwrap();
        // A pprof Label { key: "pid", num: PID }: its num field (3) holds the pid.
        pid_label |= protoc(&["--decode_raw"], &raw).contains(&format!("3: {pid}\n"));
        for n in l.keys() {
            let ok = n
                .chars()
                .enumerate()
                .all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
            assert!(ok, "label name {n:?}");
        }
    }
    assert!(pid_label, "no sample labelled with pid {pid}");
    // Their pprof payloads, merged by Go's pprof: the split's 3:1 share.
    let files: Vec<PathBuf> = mine
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let f = output_path(&format!("agent_push_{i}"), "pb.gz");
            fs::write(&f, &p.profile).unwrap();
            f
        })
        .collect();
    let rest: Vec<String> = files[1..].iter().map(|p| p.display().to_string()).collect();
    let mut args = vec!["-top", "-sample_index=samples", "-nodecount=1000", "-nodefraction=0"];
    args.extend(rest.iter().map(String::as_str));
    let out = go_pprof::run(&args, &files[0]).expect("pprof -top");
    let (_, rows) = parse_top(&out).expect("parse -top");
    let flat = |n: &str| rows.iter().find(|r| r.name == n).map_or(0.0, |r| r.flat);
    let (a, b) = (flat("hot_a"), flat("hot_b"));
    // Under load the fixture gets less CPU than its 4 s; enough samples for a ±5 share.
    assert!(a + b > 300.0, "4 s at 499 Hz: {a} + {b} samples:\n{out}");
    let share = 100.0 * a / (a + b);
    assert!((70.0..=80.0).contains(&share), "hot_a share {share:.1}%, want 75 ± 5:\n{out}");
}

/// Runs an agent against a receiver answering `code` to everything; returns its stderr and
/// the windows of each request. Every window is rejected once, logged once, not retried.
fn rejecting(test: &str, code: u16) -> (String, Vec<Vec<Pushed>>) {
    let dir = spool_dir(test);
    let receiver = Receiver::start(0, code);
    let url = format!("http://127.0.0.1:{}", receiver.port);
    // Two busy programs of different names, so two services: every window holds at least
    // two profiles, so a batch is more than one request's worth even on a quiet host (on one,
    // a window held a single profile and no batch was ever split). Two processes of one
    // program would fold into one profile (windows are per service).
    let exe = fixtures::build("split").expect("build split");
    let other = output_path(&format!("{test}_bin"), "d").join("split_other");
    std::fs::create_dir_all(other.parent().unwrap()).unwrap();
    std::fs::copy(&exe, &other).unwrap();
    let busy: Vec<Background> = [&exe, &other]
        .into_iter()
        .map(|e| Background(Command::new(e).arg("20").spawn().expect("start split")))
        .collect();
    // Queue mode (no --spool): windows are deleted once the sink is done with them.
    let mut agent = Agent::start(&[
        "--queue-dir",
        dir.to_str().unwrap(),
        "--pyroscope",
        &url,
        "--window",
        "1",
        "-F",
        "49",
    ]);
    for _ in 0..2 {
        agent.wait_for("window:", Duration::from_secs(30));
    }
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    drop(busy);
    assert!(status.success(), "{stderr}");
    let logged: Vec<&str> =
        stderr.lines().filter(|l| l.contains("rejected, not retried")).collect();
    assert_eq!(logged.len(), 1, "one log line per kind:\n{stderr}");
    let want = format!("HTTP {code}");
    let says = "receiver says no: bad labels";
    assert!(logged[0].contains(&want) && logged[0].contains(says), "{stderr}");
    let requests = decode_requests(&receiver.requests());
    let (delivered, rejected, dropped) = sink_counts(&stderr);
    assert_eq!(delivered, 0, "{stderr}");
    assert!(rejected >= 2, "2 windows of a whole host: {rejected} rejected\n{stderr}");
    assert_eq!(dropped, 0);
    let n = sink_numbers(&stderr);
    assert_eq!((n("attempts"), n("retries")), (rejected, 0), "{stderr}");
    let left = count_suffix(&dir, ".json");
    assert_eq!(left, 0, "rejected windows leave the queue: {:?}", names_in(&dir));
    // Each window is in exactly one request of every level of its batch's halving: the
    // distinct windows sent are the rejected ones.
    let ids: HashSet<&str> = requests.iter().flatten().map(|p| p.id.as_str()).collect();
    assert_eq!(ids.len() as u64, rejected, "{stderr}");
    (stderr, requests)
}

#[test]
fn agent_pyroscope_rejects_are_counted_logged_once_and_not_retried() {
    // 400 (Pyroscope's InvalidArgument: it stored none of the request) may be one window's
    // fault: halved down to single windows, each rejected alone once; a batch of k windows
    // is a binary tree of 2k-1 requests.
    let (stderr, requests) = rejecting("agent_push_reject", 400);
    let n = sink_numbers(&stderr);
    let (rejected, batches) = (n("rejected"), n("batches"));
    assert_eq!(requests.len() as u64, 2 * rejected - batches, "{stderr}");
    let mut alone = HashSet::new();
    for r in requests.iter().filter(|r| r.len() == 1) {
        assert!(alone.insert(r[0].id.clone()), "window {} rejected alone twice", r[0].id);
    }
    assert_eq!(alone.len() as u64, rejected, "every window ends alone:\n{stderr}");
    assert!(requests.iter().any(|r| r.len() > 1), "batches were sent whole first");
}

#[test]
fn agent_pyroscope_request_rejected_as_a_whole_is_not_split() {
    // 403 cannot depend on which windows a request holds: one request per batch.
    let (stderr, requests) = rejecting("agent_push_reject_403", 403);
    let n = sink_numbers(&stderr);
    assert_eq!(requests.len() as u64, n("batches"), "{stderr}");
    let windows: usize = requests.iter().map(Vec::len).sum();
    assert_eq!(windows as u64, n("rejected"), "each window sent once:\n{stderr}");
}

#[test]
fn agent_killed_while_pyroscope_is_down_sends_the_backlog_after_restart() {
    let dir = spool_dir("agent_push_kill");
    let d = dir.to_str().unwrap();
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}");
    let args = ["--queue-dir", d, "--pyroscope", &url, "--window", "1", "-F", "49"];
    let mut agent = Agent::start(&args);
    for _ in 0..2 {
        agent.wait_for("window:", Duration::from_secs(30));
    }
    let (status, _) = agent.stop(libc::SIGKILL, Duration::from_secs(5));
    assert!(!status.success());
    // The backlog: (service, start ms) of each window the first run queued.
    let backlog: Vec<(String, u64)> = names_in(&dir)
        .iter()
        .filter(|n| n.ends_with(".json"))
        .map(|n| {
            let v: serde_json::Value =
                serde_json::from_slice(&fs::read(dir.join(n)).unwrap()).unwrap();
            (v["service_name"].as_str().unwrap().to_owned(), v["start_ms"].as_u64().unwrap())
        })
        .collect();
    assert!(!backlog.is_empty(), "the first run queued windows: {:?}", names_in(&dir));

    let receiver = Receiver::start(port, 200);
    let agent = Agent::start(&args);
    let restarted = agent.seen.join("\n");
    assert!(restarted.contains(&format!("{} windows", backlog.len())), "{restarted}");
    // Wait until the restarted agent sent them all.
    let deadline = Instant::now() + Duration::from_secs(60);
    let received = loop {
        let pushed = decode_all(&receiver.requests());
        let got: Vec<(String, u64)> = pushed
            .iter()
            .map(|p| (p.labels["service_name"].clone(), time_ms(&p.profile)))
            .collect();
        let missing = backlog
            .iter()
            .filter(|(svc, ms)| !got.iter().any(|(s, m)| s == svc && m.abs_diff(*ms) <= 1))
            .count();
        if missing == 0 {
            break got.len();
        }
        assert!(Instant::now() < deadline, "{missing} of {} backlog windows unsent", backlog.len());
        thread::sleep(Duration::from_millis(300));
    };
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    let pushed = decode_all(&receiver.requests());
    assert!(pushed.len() >= received);
    let (delivered, _, dropped) = sink_counts(&stderr);
    assert!(delivered as usize >= backlog.len(), "{stderr}");
    assert_eq!(dropped, 0, "{stderr}");
}
