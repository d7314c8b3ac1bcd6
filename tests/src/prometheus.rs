//! A real Prometheus server (Debian's `prometheus` package) for tests: started on a free
//! loopback port with a temporary config and data directory, scraping the given targets every
//! second; queried through its HTTP API; stopped when dropped.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::ports;
use anyhow::{Context as _, Result, bail};
use serde_json::Value;

/// The Debian package `cargo xtask setup` installs.
pub const DEBIAN_PACKAGES: &[&str] = &["prometheus"];
pub const BIN: &str = "/usr/bin/prometheus";

pub struct Prometheus {
    child: Child,
    dir: PathBuf,
    pub base: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`IP:PORT`, path /metrics) every second and waits
    /// until it is ready.
    pub fn start(name: &str, targets: &[&str]) -> Result<Self> {
        if !std::path::Path::new(BIN).is_file() {
            bail!(
                "{BIN} is missing: run `cargo xtask setup` (it installs Debian's {})",
                DEBIAN_PACKAGES.join(" ")
            );
        }
        let dir = std::env::temp_dir().join(format!("rsprof-prom-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data"))?;
        let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - \
             job_name: rsprof\n    scrape_interval: 1s\n    scrape_timeout: 1s\n    \
             static_configs:\n      - targets: [{}]\n",
            list.join(", ")
        );
        std::fs::write(dir.join("prometheus.yml"), config)?;
        for attempt in 1..=ports::START_ATTEMPTS {
            let port = ports::free_port()?;
            let log = std::fs::File::create(dir.join("log"))?;
            let mut child = Command::new(BIN)
                .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
                .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("start prometheus")?;
            let base = format!("http://127.0.0.1:{port}");
            let log = || std::fs::read_to_string(dir.join("log")).unwrap_or_default();
            let end = Instant::now() + Duration::from_secs(60);
            loop {
                if ureq::get(format!("{base}/-/ready")).call().is_ok() {
                    return Ok(Self { child, dir, base });
                }
                if let Ok(Some(status)) = child.try_wait() {
                    // Another process took the port between the probe and Prometheus's bind.
                    if attempt < ports::START_ATTEMPTS && ports::in_use(&log()) {
                        eprintln!("prometheus: port {port} taken, starting on another");
                        break;
                    }
                    bail!("prometheus exited ({status}) at start:\n{}", log());
                }
                if Instant::now() > end {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("prometheus not ready in 60 s:\n{}", log());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        unreachable!("the last attempt returns")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// The result vector of an instant query (`/api/v1/query`); an error with Prometheus's
    /// message if the query is invalid.
    pub fn query(&self, promql: &str) -> Result<Vec<Value>> {
        // Prometheus explains a bad query in the body of its 400 answer.
        let body = ureq::get(format!("{}/api/v1/query", self.base))
            .config()
            .http_status_as_error(false)
            .build()
            .query("query", promql)
            .call()?
            .into_body()
            .read_to_string()?;
        let v: Value =
            serde_json::from_str(&body).with_context(|| format!("query {promql}: {body}"))?;
        if v["status"] != "success" {
            bail!("query {promql}: {}", v["error"]);
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// Values of label `label` among series matching `selector` (Grafana's `label_values`).
    pub fn label_values(&self, label: &str, selector: &str) -> Result<Vec<String>> {
        let body = ureq::get(format!("{}/api/v1/label/{label}/values", self.base))
            .query("match[]", selector)
            .call()?
            .into_body()
            .read_to_string()?;
        let v: Value = serde_json::from_str(&body)?;
        Ok(v["data"]
            .as_array()
            .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
            .unwrap_or_default())
    }
}

/// The number in a query result's sample (`[time, "value"]`).
pub fn value_of(sample: &Value) -> f64 {
    sample["value"][1].as_str().and_then(|s| s.parse().ok()).unwrap_or(f64::NAN)
}
