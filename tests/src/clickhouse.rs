//! A real ClickHouse server for tests: Debian's `clickhouse-server` (installed by `cargo xtask
//! setup`) started on free loopback ports with its own temporary data directory and a
//! generated config (the `<yandex>` XML format of 18.16, which current releases still read),
//! killed and removed on drop. A server that does not come up fails the test with its log.

use std::{
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::ports;

/// The Debian packages `cargo xtask setup` installs for it.
pub const DEBIAN_PACKAGES: &[&str] = &["clickhouse-server", "clickhouse-client"];

/// The server binary: Debian puts it in /usr/sbin (not on a user's PATH).
fn server_binary() -> Result<PathBuf> {
    for p in ["/usr/sbin/clickhouse-server", "/usr/bin/clickhouse-server"] {
        if Path::new(p).is_file() {
            return Ok(p.into());
        }
    }
    bail!(
        "clickhouse-server not found in /usr/sbin or /usr/bin: run `cargo xtask setup` (it \
         installs Debian's {})",
        DEBIAN_PACKAGES.join(" ")
    )
}

pub struct Server {
    pub dir: PathBuf,
    pub http_port: u16,
    tcp_port: u16,
    child: Option<Child>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Server {
    /// Starts a server and waits until it answers `/ping`.
    pub fn start() -> Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rsprof-clickhouse-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("data"))?;
        let mut s = Self { dir, http_port: 0, tcp_port: 0, child: None };
        for attempt in 1..=ports::START_ATTEMPTS {
            (s.http_port, s.tcp_port) = (ports::free_port()?, ports::free_port()?);
            s.write_config()?;
            match s.resume() {
                Ok(()) => return Ok(s),
                // Another process took a port between the probe and the server's bind.
                Err(e) if attempt < ports::START_ATTEMPTS && ports::in_use(&s.log()) => {
                    eprintln!("clickhouse-server: port taken, starting on new ports: {e:#}");
                    for f in ["stdout.log", "server.err.log", "server.log"] {
                        let _ = fs::remove_file(s.dir.join(f));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    fn write_config(&self) -> Result<()> {
        let d = self.dir.display();
        let config = format!(
            r#"<?xml version="1.0"?>
<yandex>
  <logger>
    <level>information</level>
    <log>{d}/server.log</log>
    <errorlog>{d}/server.err.log</errorlog>
    <console>0</console>
  </logger>
  <listen_host>127.0.0.1</listen_host>
  <http_port>{}</http_port>
  <tcp_port>{}</tcp_port>
  <path>{d}/data/</path>
  <tmp_path>{d}/data/tmp/</tmp_path>
  <user_files_path>{d}/data/user_files/</user_files_path>
  <format_schema_path>{d}/data/format_schemas/</format_schema_path>
  <users_config>{d}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>67108864</mark_cache_size>
  <uncompressed_cache_size>67108864</uncompressed_cache_size>
  <timezone>UTC</timezone>
</yandex>
"#,
            self.http_port, self.tcp_port
        );
        let users = r#"<?xml version="1.0"?>
<yandex>
  <profiles><default></default></profiles>
  <users>
    <default>
      <password></password>
      <networks><ip>127.0.0.1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </default>
  </users>
  <quotas><default></default></quotas>
</yandex>
"#;
        fs::write(self.dir.join("config.xml"), config)?;
        fs::write(self.dir.join("users.xml"), users)?;
        Ok(())
    }

    /// The server's logs, for failure messages.
    pub fn log(&self) -> String {
        ["stdout.log", "server.err.log", "server.log"]
            .iter()
            .filter_map(|f| {
                let text = fs::read_to_string(self.dir.join(f)).ok()?;
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                Some(format!("--- {f} ---\n{}", tail.join("\n")))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Starts the server (again) with the same ports and data, and waits for `/ping`.
    pub fn resume(&mut self) -> Result<()> {
        let out = fs::File::create(self.dir.join("stdout.log"))?;
        let child = Command::new(server_binary()?)
            .arg(format!("--config-file={}", self.dir.join("config.xml").display()))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("start clickhouse-server")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((200, body)) = self.http("GET", "/ping", "")
                && body.starts_with("Ok.")
            {
                return Ok(());
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("clickhouse-server exited ({status}) at start:\n{}", self.log());
            }
            if Instant::now() > deadline {
                let log = self.log();
                self.kill();
                bail!("clickhouse-server did not answer /ping within 60 s:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the server (a crash, not a shutdown); `resume` starts it again.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Runs `sql` and returns its output; an error carries the server's message.
    pub fn query(&self, sql: &str) -> Result<String> {
        match self.http("POST", "/", sql)? {
            (200, body) => Ok(body),
            (code, body) => bail!("HTTP {code} for `{sql}`: {body}"),
        }
    }

    /// One HTTP/1.0 request (the server closes the connection after it).
    fn http(&self, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.http_port))?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        write!(
            s,
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header end")?;
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .context("no HTTP status")?;
        Ok((code, body.to_owned()))
    }
}
