//! `rsprof-bpf list-containers`: the containers, systemd services and other populated
//! cgroups on this host, with runtime, id, pod UID, QoS class, process count and path.

use std::fmt::Write as _;

use anyhow::Result;

use crate::system::cgroup::{
    filter::{display_id, survey},
    fs::V2Mount,
};

pub fn run() -> Result<()> {
    let mount = V2Mount::find()?;
    let found = survey(&mount);
    let mut out = String::new();
    let _ = writeln!(out, "cgroup v2 mount: {}", mount.path.display());
    let _ = writeln!(
        out,
        "{:<11} {:<24} {:<36} {:<10} {:>6}  CGROUP",
        "RUNTIME", "ID", "POD", "QOS", "PROCS"
    );
    for f in &found {
        let (rt, id, pod, qos) = match &f.identity {
            Some(i) => (
                i.runtime.name(),
                display_id(i),
                i.pod_uid.as_deref().unwrap_or("-"),
                i.qos.map_or("-", |q| q.name()),
            ),
            None => ("-", "-", "-", "-"),
        };
        let _ = writeln!(
            out,
            "{rt:<11} {id:<24} {pod:<36} {qos:<10} {:>6}  {}",
            f.nprocs, f.cgroup.path
        );
    }
    print!("{out}");
    Ok(())
}
