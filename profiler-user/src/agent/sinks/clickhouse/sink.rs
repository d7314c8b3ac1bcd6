//! The sink: spooled windows inserted exactly once (see the module header), retention kept.

use super::*;

/// What the sink did, for the agent's report.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClickHouseStats {
    /// Windows inserted.
    pub inserted: u64,
    /// Windows already stored (a repeated delivery), not inserted again.
    pub already_stored: u64,
    pub sample_rows: u64,
    pub stack_rows: u64,
    /// Day partitions dropped for retention (servers without TTL).
    pub partitions_dropped: u64,
}

pub struct ClickHouseSink {
    client: Client,
    retention_days: u32,
    /// Known to exist; `Some(ttl)`: whether the tables have a TTL.
    schema: Option<bool>,
    pub(super) last_retention: Option<Instant>,
    /// Stacks this sink stored (day, hash): not sent again, so a steady workload's windows
    /// are one insert of samples and one of the commit record. Cleared with the schema.
    sent_stacks: HashSet<(u64, u64)>,
    pub stats: ClickHouseStats,
}

/// Bound on `sent_stacks` (about 40 MB); it starts over beyond.
pub(super) const SENT_STACKS_MAX: usize = 1 << 20;

impl ClickHouseSink {
    pub fn new(url: &str, retention_days: u32) -> Result<Self> {
        if retention_days == 0 {
            bail!("invalid ClickHouse retention: at least 1 day");
        }
        Ok(Self {
            client: Client::new(url, Duration::from_secs(30))?,
            retention_days,
            schema: None,
            last_retention: None,
            sent_stacks: HashSet::new(),
            stats: Default::default(),
        })
    }

    /// Creates the tables if missing (once, and again after an unknown-table error).
    pub(super) fn ensure_schema(&mut self) -> Result<bool, Failure> {
        if let Some(ttl) = self.schema {
            return Ok(ttl);
        }
        let version = self.client.run("SELECT version()", None)?;
        let mut v = version.trim().split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        // TTL came with 19.6.
        let ttl = (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (19, 6);
        for sql in schema(ttl.then_some(self.retention_days)) {
            self.client.run(&sql, None)?;
        }
        add_elf_columns(&self.client)?;
        self.schema = Some(ttl);
        Ok(ttl)
    }

    /// Without TTL: drops the day partitions past the retention, at most once an hour.
    fn retention(&mut self) -> Result<(), Failure> {
        if self.last_retention.is_some_and(|t| t.elapsed() < RETENTION_EVERY) {
            return Ok(());
        }
        self.last_retention = Some(Instant::now());
        let tables = TABLES.map(quote).join(", ");
        let sql = format!(
            "SELECT DISTINCT table, partition FROM system.parts WHERE database = \
             currentDatabase() AND active AND table IN ({tables}) AND partition < \
             toString(toYYYYMMDD(today() - {})) FORMAT TSV",
            self.retention_days
        );
        for line in self.client.run(&sql, None)?.lines() {
            let Some((table, partition)) = line.split_once('\t') else { continue };
            // Only our tables and numeric partitions (YYYYMMDD) reach the ALTER.
            if TABLES.contains(&table) && partition.bytes().all(|b| b.is_ascii_digit()) {
                self.client
                    .run(&format!("ALTER TABLE {table} DROP PARTITION {partition}"), None)?;
                self.stats.partitions_dropped += 1;
            }
        }
        Ok(())
    }

    /// Which of `labels` have their commit record already: one query for the batch.
    fn stored(&self, labels: &[LabelRow]) -> Result<HashSet<(String, String)>, Failure> {
        let list = |f: fn(&LabelRow) -> &str| {
            let mut v: Vec<&str> = labels.iter().map(f).collect();
            v.sort_unstable();
            v.dedup();
            v.into_iter().map(quote).collect::<Vec<_>>().join(", ")
        };
        let from = labels.iter().map(|l| l.window_start).min().unwrap_or(0);
        let to = labels.iter().map(|l| l.window_start).max().unwrap_or(0);
        // The sort key's prefix (service, host, time) narrows the scan; ids pick the rows.
        let sql = format!(
            "SELECT host, window_id FROM rsprof_windows WHERE service_name IN ({}) AND host IN \
             ({}) AND window_start >= toDateTime({from}) AND window_start <= toDateTime({to}) \
             AND window_id IN ({}) FORMAT JSONEachRow",
            list(|l| &l.service_name),
            list(|l| &l.host),
            list(|l| &l.window_id)
        );
        #[derive(Deserialize)]
        struct Key {
            host: String,
            window_id: String,
        }
        let keys: Vec<Key> = json_rows(&self.client.run(&sql, None)?)
            .map_err(|e| Failure::Transient(e.context("reading stored windows")))?;
        Ok(keys.into_iter().map(|k| (k.host, k.window_id)).collect())
    }

    fn insert(&self, table: &str, rows: &[u8]) -> Result<(), Failure> {
        self.client.run(&format!("INSERT INTO {table} FORMAT JSONEachRow"), Some(rows)).map(drop)
    }

    /// Inserts the windows of `batch` not stored yet: one existence check, then one insert
    /// per table for all of them (ClickHouse makes a data part per insert, so fewer, larger
    /// inserts are what keeps it merging), the commit records last.
    fn deliver_rows(&mut self, batch: &[&WindowRows], stacks: &Stacks) -> Result<(), Failure> {
        if batch.is_empty() {
            return Ok(());
        }
        let ttl = self.ensure_schema()?;
        if !ttl {
            self.retention()?;
        }
        let labels: Vec<LabelRow> = batch.iter().map(|w| LabelRow::of(&w.meta)).collect();
        let stored = self.stored(&labels)?;
        let new: Vec<(&WindowRows, &LabelRow)> = (batch.iter().copied().zip(&labels))
            .filter(|(_, l)| !stored.contains(&(l.host.clone(), l.window_id.clone())))
            .collect();
        self.stats.already_stored += (batch.len() - new.len()) as u64;
        if new.is_empty() {
            return Ok(());
        }
        // Midnight UTC as a DateTime: 18.16 reads a Date from JSON only as "YYYY-MM-DD".
        let mut used: Vec<(u64, u64)> = (new.iter())
            .flat_map(|(w, l)| {
                let day = l.window_start / 86_400 * 86_400;
                w.rows.iter().map(move |r| (day, r.stack))
            })
            .filter(|&(day, h)| h != 0 && !self.sent_stacks.contains(&(day, h)))
            .collect();
        used.sort_unstable();
        used.dedup();
        let stack_rows = (used.iter())
            .filter_map(|&(day, h)| Some(StackRow::of(day, h, stacks.get(&h)?)))
            .collect::<Vec<_>>();
        if !stack_rows.is_empty() {
            self.insert("rsprof_stacks", &json_lines(&stack_rows))?;
            if self.sent_stacks.len() + used.len() > SENT_STACKS_MAX {
                self.sent_stacks.clear();
            }
            self.sent_stacks.extend(used.iter().copied());
        }
        let samples = new
            .iter()
            .flat_map(|&(w, labels)| w.rows.iter().map(move |r| SampleRow::of(labels, r)));
        let sample_rows: usize = new.iter().map(|(w, _)| w.rows.len()).sum();
        if sample_rows > 0 {
            self.insert("rsprof_samples", &json_lines(samples))?;
        }
        let windows = new.iter().map(|&(w, labels)| WindowRow {
            labels,
            process: &labels.process,
            pid: labels.pid,
            samples: w.rows.iter().map(|r| r.samples).sum(),
            sample_rows: w.rows.len() as u64,
            period_ns: w.period_ns.max(0) as u64,
        });
        self.insert("rsprof_windows", &json_lines(windows))?;
        self.stats.inserted += new.len() as u64;
        self.stats.sample_rows += sample_rows as u64;
        self.stats.stack_rows += stack_rows.len() as u64;
        Ok(())
    }

    /// Delivers windows already in row form (what `deliver_batch` does after decoding), all
    /// or none: one result for the batch.
    pub fn deliver_windows(
        &mut self,
        batch: &[&WindowRows],
        stacks: &Stacks,
    ) -> Result<(), SinkError> {
        self.deliver_rows(batch, stacks).map_err(|f| self.failed(f))
    }

    fn failed(&mut self, f: Failure) -> SinkError {
        if matches!(&f, Failure::Refused { code: Some(UNKNOWN_TABLE), .. }) {
            self.schema = None;
            self.sent_stacks.clear();
        }
        f.into_sink_error()
    }
}

impl RemoteSink for ClickHouseSink {
    fn name(&self) -> &'static str {
        "clickhouse"
    }

    fn deliver(&mut self, meta: &WindowMeta, pprof_gz: &[u8]) -> Result<(), SinkError> {
        let mut stacks = Stacks::new();
        let w = decode(meta, pprof_gz, &mut stacks)?;
        self.deliver_windows(&[&w], &stacks)
    }

    fn deliver_batch(&mut self, windows: &[(WindowMeta, Vec<u8>)]) -> Vec<Result<(), SinkError>> {
        let mut stacks = Stacks::new();
        let decoded: Vec<Result<WindowRows, SinkError>> =
            windows.iter().map(|(meta, gz)| decode(meta, gz, &mut stacks)).collect();
        let good: Vec<&WindowRows> = decoded.iter().filter_map(|r| r.as_ref().ok()).collect();
        let batch = match self.deliver_rows(&good, &stacks) {
            Ok(()) => Ok(()),
            // One refused window must not take the others with it: find it, one at a time.
            Err(Failure::Refused { code, .. }) if good.len() > 1 && code != Some(UNKNOWN_TABLE) => {
                return (decoded.into_iter())
                    .map(|r| r.and_then(|w| self.deliver_windows(&[&w], &stacks)))
                    .collect();
            }
            Err(f) => Err(self.failed(f)),
        };
        let copy = |e: &SinkError| match e {
            SinkError::Retry(e) => SinkError::Retry(anyhow!("{e:#}")),
            SinkError::Reject(e) => SinkError::Reject(anyhow!("{e:#}")),
        };
        (decoded.into_iter())
            .map(|r| match (&batch, r) {
                (_, Err(e)) => Err(e),
                (Ok(()), Ok(_)) => Ok(()),
                (Err(e), Ok(_)) => Err(copy(e)),
            })
            .collect()
    }
}

/// A spooled window's rows, its stacks added to `stacks`; a window that does not decode is
/// rejected (sending it again would not help).
pub(super) fn decode(
    meta: &WindowMeta,
    pprof_gz: &[u8],
    stacks: &mut Stacks,
) -> Result<WindowRows, SinkError> {
    rows::read_pprof_gz(pprof_gz)
        .and_then(|p| rows::from_pprof(meta.clone(), &p, stacks))
        .map_err(|e| SinkError::Reject(e.context(format!("window {}", meta.window_id))))
}
