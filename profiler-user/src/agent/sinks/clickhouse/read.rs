//! The reading side of `query --clickhouse`: the windows a selection names, their samples
//! (RowBinary: a fleet query reads millions of rows) and stacks.

use super::*;

/// The SQL conditions of a selection on the label columns of the samples table (`rows`) or
/// the windows table: a window of a service has no process of its own, its rows do (a window
/// of an older agent has one, also on its rows).
pub(super) fn conditions(sel: &Selection, rows: bool) -> String {
    let from_s = (sel.from_ms / 1000).saturating_sub(MAX_WINDOW_SECS);
    let to_s = (sel.to_ms / 1000).saturating_add(1).min(u64::from(u32::MAX));
    let mut w = format!(
        "window_start >= toDateTime({from_s}) AND window_start < toDateTime({to_s}) AND end_ms > \
         {} AND start_ms < {}",
        sel.from_ms, sel.to_ms
    );
    let list = |v: &[String]| v.iter().map(|s| quote(s)).collect::<Vec<_>>().join(", ");
    for (col, values) in [("host", &sel.hosts), ("service_name", &sel.services)] {
        if !values.is_empty() {
            let _ = write!(w, " AND {col} IN ({})", list(values));
        }
    }
    let pids = sel.pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
    let either = if rows { "0" } else { "process = ''" };
    if !sel.processes.is_empty() {
        let _ = write!(w, " AND ({either} OR process IN ({}))", list(&sel.processes));
    }
    if !sel.pids.is_empty() {
        let _ = write!(w, " AND ({either} OR pid IN ({pids}))");
    }
    if !sel.containers.is_empty() {
        let any: Vec<String> = (sel.containers.iter().filter(|c| !c.is_empty()))
            .map(|c| format!("substring(container_id, 1, {}) = {}", c.len(), quote(c)))
            .collect();
        let any = if any.is_empty() { "0".to_owned() } else { any.join(" OR ") };
        let _ = write!(w, " AND ({any})");
    }
    w
}

#[derive(Deserialize)]
pub(super) struct ReadWindow {
    #[serde(flatten)]
    labels: LabelRow,
    #[serde(deserialize_with = "u64_any")]
    samples: u64,
    #[serde(deserialize_with = "u64_any")]
    sample_rows: u64,
    #[serde(deserialize_with = "u64_any")]
    period_ns: u64,
}

/// ClickHouse's `RowBinary` output, read row by row as it arrives: integers little-endian,
/// strings as a LEB128 length and their bytes. Much cheaper to produce and parse than JSON for
/// the millions of sample rows of a fleet query.
pub(super) struct RowBinary<R> {
    r: R,
}

impl<R: std::io::BufRead> RowBinary<R> {
    fn at_end(&mut self) -> Result<bool> {
        Ok(self.r.fill_buf().context("reading ClickHouse's answer")?.is_empty())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0; N];
        self.r.read_exact(&mut b).context("ClickHouse's RowBinary answer ends inside a row")?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Appends a string's bytes to `out`.
    fn string(&mut self, out: &mut Vec<u8>) -> Result<()> {
        let mut len = 0u64;
        for shift in (0..64).step_by(7) {
            let [b] = self.array()?;
            len |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return self.bytes(len, out);
            }
        }
        bail!("bad string length in ClickHouse's RowBinary answer")
    }

    /// Appends the next `len` bytes to `out`.
    fn bytes(&mut self, len: u64, out: &mut Vec<u8>) -> Result<()> {
        anyhow::ensure!(len < 1 << 30, "bad string length in ClickHouse's RowBinary answer");
        let len = len as usize;
        let buffered = self.r.fill_buf().context("reading ClickHouse's answer")?;
        if buffered.len() >= len {
            out.extend_from_slice(&buffered[..len]);
            self.r.consume(len);
            return Ok(());
        }
        let start = out.len();
        out.resize(start + len, 0);
        (self.r.read_exact(&mut out[start..]))
            .context("ClickHouse's RowBinary answer ends inside a row")
    }
}

/// The selected windows stored in ClickHouse at `url`, oldest first, with their stacks: the
/// same form `query` reads from a spool.
pub fn read_windows(url: &str, sel: &Selection) -> Result<(Vec<WindowRows>, Stacks)> {
    let client = Client::new(url, Duration::from_secs(600))?;
    let (cond, row_cond) = (conditions(sel, false), conditions(sel, true));
    let labels = "start_ms, end_ms, host, service_name, process, pid, container_runtime, container_id, pod_uid, pod_qos, \
                  systemd_unit, window_id";
    let windows: Vec<ReadWindow> = json_rows(&client.query(&format!(
        "SELECT {labels}, samples, sample_rows, period_ns FROM rsprof_windows FINAL WHERE {cond} FORMAT \
         JSONEachRow"
    ))?)?;
    let mut out: Vec<(WindowRows, u64)> = windows
        .into_iter()
        .map(|w| {
            let rows = WindowRows {
                meta: w.labels.meta(w.samples),
                period_ns: w.period_ns as i64,
                rows: Vec::new(),
            };
            (rows, w.sample_rows)
        })
        .filter(|(w, _)| sel.selects(&w.meta))
        .collect();
    out.sort_by(|(a, _), (b, _)| {
        (a.meta.start_ms, &a.meta.labels.host, &a.meta.window_id).cmp(&(
            b.meta.start_ms,
            &b.meta.labels.host,
            &b.meta.window_id,
        ))
    });
    let (mut out, sample_rows): (Vec<WindowRows>, Vec<u64>) = out.into_iter().unzip();
    // Window key: service, host and window id (the sort key's identity of a window), apart by
    // a byte no UTF-8 text has.
    let index: HashMap<Vec<u8>, usize> = (out.iter().enumerate())
        .map(|(i, w)| {
            let mut k = Vec::new();
            for part in [&w.meta.labels.service_name, &w.meta.labels.host, &w.meta.window_id] {
                k.extend_from_slice(part.as_bytes());
                k.push(0xff);
            }
            (k, i)
        })
        .collect();
    // `FINAL` collapses the rows a repeated insert stored again until parts merge (measured on
    // the bench-agent fleet, faster than grouping by the whole sort key: that hashes every
    // row's strings). RowBinary: half of JSON's bytes, and cheap to parse.
    let body = (client.run_reader(&format!(
        "SELECT service_name, host, window_id, process, pid, tid, thread_name, stack_hash, \
         samples, cpu_ns, off_cpu_ns FROM rsprof_samples FINAL WHERE {row_cond} FORMAT RowBinary"
    )))
    .map_err(Failure::into_error)?;
    let mut rd = RowBinary { r: std::io::BufReader::with_capacity(1 << 20, body) };
    let (mut k, mut thread, mut process) = (Vec::new(), Vec::new(), Vec::new());
    while !rd.at_end()? {
        k.clear();
        for _ in 0..3 {
            rd.string(&mut k)?;
            k.push(0xff);
        }
        process.clear();
        rd.string(&mut process)?;
        let pid = rd.u32()?;
        let tid = rd.u32()?;
        thread.clear();
        rd.string(&mut thread)?;
        let (stack, samples, cpu_ns, off_cpu_ns) = (rd.u64()?, rd.u64()?, rd.u64()?, rd.u64()?);
        // Rows of a window without its commit record (a delivery that never completed).
        let Some(&i) = index.get(k.as_slice()) else { continue };
        out[i].rows.push(rows::StackRow {
            pid,
            process: String::from_utf8_lossy(&process).into_owned(),
            tid,
            thread: String::from_utf8_lossy(&thread).into_owned(),
            stack,
            samples,
            cpu_ns,
            off_cpu_ns,
        });
    }
    // A committed window has all its rows (they are inserted before its commit record): fewer
    // means the answer was cut short (an error after the server started sending). With rows
    // selected by process, a window has fewer by design, and none when no row matched.
    if sel.filters_rows() {
        out.retain(|w| !w.rows.is_empty());
    }
    for (w, &want) in out.iter().zip(&sample_rows).filter(|_| !sel.filters_rows()) {
        anyhow::ensure!(
            w.rows.len() as u64 == want,
            "ClickHouse returned {} sample rows of window {} of host {}, its commit record says {want}",
            w.rows.len(),
            w.meta.window_id,
            w.meta.labels.host
        );
    }
    // In the sort key's order, which is how `FINAL` returns a window's rows unless a server
    // spreads one over several streams: the same rows make the same profile.
    let order = |a: &rows::StackRow, b: &rows::StackRow| {
        (a.tid, &a.thread, a.stack).cmp(&(b.tid, &b.thread, b.stack))
    };
    for w in &mut out {
        if !w.rows.is_sorted_by(|a, b| order(a, b).is_le()) {
            w.rows.sort_unstable_by(order);
        }
    }
    // Tables of older agents lack the columns of unnamed frames.
    let have = columns(&client, "rsprof_stacks").map_err(Failure::into_error)?;
    let elf = match ELF_COLUMNS.iter().all(|(n, _)| have.contains(*n)) {
        true => ", any(build_ids) AS build_ids, any(addrs) AS addrs",
        false => "",
    };
    let stack_rows: Vec<StackRow> = json_rows(&client.query(&format!(
        "SELECT stack_hash, any(functions) AS functions, any(modules) AS modules, any(files) AS \
         files, any(lines) AS lines, any(cols) AS cols, any(inlined) AS inlined{elf} FROM \
         rsprof_stacks WHERE stack_hash IN (SELECT stack_hash FROM rsprof_samples WHERE {row_cond}) \
         GROUP BY stack_hash FORMAT JSONEachRow"
    ))?)?;
    let stacks = stack_rows.into_iter().map(|r| (r.stack_hash, r.frames())).collect();
    Ok((out, stacks))
}
