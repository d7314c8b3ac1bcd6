//! Names, when windows are read (`query`), the frames an agent could not name on its host
//! (a stripped file whose debug file the host lacks): the agent keeps each as a location whose
//! mapping carries the file's build-id and whose address is the frame's ELF virtual address
//! (`symbolize::unnamed_addresses`); here that pair is named from a debug file found by the
//! build-id (`symbolize::by_build_id`) and the location's lines replaced by its frames.

use std::collections::HashMap;

use crate::{symbolize::by_build_id::ByBuildId, writers::pprof::proto};

/// Replaces the lines of `p`'s unnamed locations that `names` can name; pairs it cannot stay
/// as they are (and are counted in its stats).
pub fn name_locations(p: &mut proto::Profile, names: &mut ByBuildId) {
    let pairs = unnamed_pairs(p);
    if pairs.is_empty() {
        return;
    }
    let mut wanted: Vec<(String, u64)> = pairs.values().cloned().collect();
    wanted.sort_unstable();
    wanted.dedup();
    names.name(&wanted);
    let mut strings: HashMap<String, i64> =
        (p.string_table.iter().enumerate()).map(|(i, s)| (s.clone(), i as i64)).collect();
    let mut string = |table: &mut Vec<String>, s: &str| -> i64 {
        *strings.entry(s.to_owned()).or_insert_with(|| {
            table.push(s.to_owned());
            table.len() as i64 - 1
        })
    };
    let mut functions: HashMap<(i64, i64), u64> =
        p.function.iter().map(|f| ((f.name, f.filename), f.id)).collect();
    let mut next_function = p.function.iter().map(|f| f.id).max().unwrap_or(0) + 1;
    for loc in &mut p.location {
        let Some((id, addr)) = pairs.get(&loc.id) else { continue };
        let Some(frames) = names.frames(id, *addr) else { continue };
        // pprof lists a location's lines innermost first.
        let mut lines = Vec::with_capacity(frames.len());
        for f in frames.iter().rev() {
            let name = string(&mut p.string_table, &f.function);
            let file = f.file.as_deref().map_or(0, |x| string(&mut p.string_table, x));
            let function_id = *functions.entry((name, file)).or_insert_with(|| {
                let id = next_function;
                next_function += 1;
                p.function.push(proto::Function {
                    id,
                    name,
                    system_name: name,
                    filename: file,
                    start_line: 0,
                });
                id
            });
            lines.push(proto::Line {
                function_id,
                line: f.line.map_or(0, i64::from),
                column: f.column.map_or(0, i64::from),
            });
        }
        loc.line = lines;
    }
}

/// (build-id, address) of each location of `p` left unnamed with both, by location id.
fn unnamed_pairs(p: &proto::Profile) -> HashMap<u64, (String, u64)> {
    let s = |i: i64| p.string_table.get(i as usize).map_or("", String::as_str);
    let build_ids: HashMap<u64, &str> = (p.mapping.iter())
        .filter(|m| !s(m.filename).starts_with('['))
        .map(|m| (m.id, s(m.build_id)))
        .filter(|(_, id)| !id.is_empty())
        .collect();
    let names: HashMap<u64, &str> = p.function.iter().map(|f| (f.id, s(f.name))).collect();
    let unnamed = |function_id: u64| {
        names
            .get(&function_id)
            .and_then(|n| n.strip_prefix("0x"))
            .is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    (p.location.iter())
        .filter(|l| l.address != 0)
        .filter(|l| matches!(l.line.as_slice(), [line] if unnamed(line.function_id)))
        .filter_map(|l| Some((l.id, (build_ids.get(&l.mapping_id)?.to_string(), l.address))))
        .collect()
}
