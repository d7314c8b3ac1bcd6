//! Names of frames agents left unnamed, per (build-id, ELF address), as `query` found them in
//! debug files: read before naming, written after, so a fleet names each address once.

use super::*;

pub(super) const NAMES_TABLE: &str = "CREATE TABLE IF NOT EXISTS rsprof_names (
    build_id String,
    address UInt64,
    functions Array(String),
    files Array(String),
    lines Array(UInt32),
    cols Array(UInt32),
    inlined Array(UInt8)
) ENGINE = ReplacingMergeTree() ORDER BY (build_id, address)";

/// A row of `rsprof_names`: the frames at one address, outermost first.
#[derive(Serialize, Deserialize)]
pub(super) struct NameRow {
    build_id: String,
    #[serde(deserialize_with = "u64_any")]
    address: u64,
    functions: Vec<String>,
    files: Vec<String>,
    lines: Vec<u32>,
    cols: Vec<u32>,
    inlined: Vec<u8>,
}

/// The names the database at `url` holds for `wanted` (frames outermost first, `module`
/// empty); none when it has no `rsprof_names` yet.
pub fn stored_names(url: &str, wanted: &[ElfAddress]) -> Result<Vec<(ElfAddress, Vec<Frame>)>> {
    let client = Client::new(url, Duration::from_secs(600))?;
    if wanted.is_empty()
        || columns(&client, "rsprof_names").map_err(Failure::into_error)?.is_empty()
    {
        return Ok(Vec::new());
    }
    let mut ids: Vec<String> = wanted.iter().map(|e| quote(&e.build_id)).collect();
    ids.sort_unstable();
    ids.dedup();
    let addrs: Vec<String> = wanted.iter().map(|e| e.address.to_string()).collect();
    let rows: Vec<NameRow> = json_rows(&client.query(&format!(
        "SELECT build_id, address, any(functions) AS functions, any(files) AS files, any(lines) \
         AS lines, any(cols) AS cols, any(inlined) AS inlined FROM rsprof_names WHERE build_id \
         IN ({}) AND address IN ({}) GROUP BY build_id, address FORMAT JSONEachRow",
        ids.join(", "),
        addrs.join(", ")
    ))?)?;
    let wanted: HashSet<&ElfAddress> = wanted.iter().collect();
    Ok(rows
        .into_iter()
        .map(|r| {
            let at = ElfAddress { build_id: r.build_id.clone(), address: r.address };
            let stack = StackRow {
                day: 0,
                stack_hash: 0,
                modules: vec![String::new(); r.functions.len()],
                functions: r.functions,
                files: r.files,
                lines: r.lines,
                cols: r.cols,
                inlined: r.inlined,
                build_ids: Vec::new(),
                addrs: Vec::new(),
            };
            (at, stack.frames())
        })
        .filter(|(at, frames)| wanted.contains(at) && !frames.is_empty())
        .collect())
}

/// Stores names `query` found (see `rsprof_names`), the table made if missing.
pub fn store_names(url: &str, named: &[(ElfAddress, Vec<Frame>)]) -> Result<()> {
    if named.is_empty() {
        return Ok(());
    }
    let client = Client::new(url, Duration::from_secs(60))?;
    client.query(NAMES_TABLE)?;
    let rows = named.iter().map(|(at, frames)| NameRow {
        build_id: at.build_id.clone(),
        address: at.address,
        functions: frames.iter().map(|f| f.function.clone()).collect(),
        files: frames.iter().map(|f| f.file.clone().unwrap_or_default()).collect(),
        lines: frames.iter().map(|f| f.line.unwrap_or(0)).collect(),
        cols: frames.iter().map(|f| f.column.unwrap_or(0)).collect(),
        inlined: frames.iter().map(|f| u8::from(f.inlined)).collect(),
    });
    (client.run("INSERT INTO rsprof_names FORMAT JSONEachRow", Some(&json_lines(rows))))
        .map(drop)
        .map_err(Failure::into_error)
}
