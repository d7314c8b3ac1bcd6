//! Container identity from a cgroup v2 path (the `0::` line of `/proc/PID/cgroup`).
//!
//! Pure string parsing, no I/O. The innermost cgroup that names a container wins, so processes
//! in sub-cgroups of a container (`libpod-<id>.scope/container`, a systemd `init.scope` inside
//! a container, a test's nested cgroup) still belong to it. Recognized layouts:
//!
//! | runtime | cgroup names |
//! |---|---|
//! | Docker | `docker-<id>.scope` (systemd driver, also rootless), `/docker/<id>` (cgroupfs) |
//! | containerd (CRI) | `cri-containerd-<id>.scope`, `…slice:cri-containerd:<id>` |
//! | CRI-O | `crio-<id>.scope` (`crio-conmon-<id>.scope` is the monitor, not the container) |
//! | Podman | `libpod-<id>.scope`, `/libpod_parent/libpod-<id>` (`libpod-conmon-…` is conmon) |
//! | LXC / Incus | `/lxc/<name>`, `lxc.payload.<name>`, `/lxc.payload/<name>` |
//! | Kubernetes, cgroupfs driver | `/kubepods/[burstable/|besteffort/]pod<uid>/<id>` |
//! | systemd service | `<name>.service` (no container above it) |
//!
//! Kubernetes pods add the pod UID (`pod<uid>` or `kubepods-…-pod<uid_with_underscores>.slice`)
//! and the QoS class (`burstable`, `besteffort`, otherwise guaranteed).

pub use crate::model::container::{Identity, Qos, Runtime};

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Container ids are 64 hex digits; accept 12 or more so shortened ids in hand-made layouts
/// still parse, but never a word like `buildkit`.
fn container_id(s: &str) -> Option<String> {
    (s.len() >= 12 && s.len() <= 64 && is_hex(s)).then(|| s.to_ascii_lowercase())
}

/// `<prefix><id>.scope` → id.
fn scope_id<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    name.strip_prefix(prefix)?.strip_suffix(".scope")
}

/// The container named by one path component, given its parent component.
fn component_container(name: &str, parent: Option<&str>) -> Option<(Runtime, String)> {
    // `crio-conmon-…` and `libpod-conmon-…` fail the hex check below, as they should.
    for (prefix, runtime) in [
        ("docker-", Runtime::Docker),
        ("cri-containerd-", Runtime::Containerd),
        ("crio-", Runtime::CriO),
        ("libpod-", Runtime::Podman),
    ] {
        if let Some(id) = scope_id(name, prefix).and_then(container_id) {
            return Some((runtime, id));
        }
    }
    // cgroupfs-style names of the systemd driver: `<pod slice>:cri-containerd:<id>`.
    if let Some((_, rest)) = name.split_once(":cri-containerd:") {
        return container_id(rest).map(|id| (Runtime::Containerd, id));
    }
    if let Some((_, rest)) = name.split_once(":crio:") {
        return container_id(rest).map(|id| (Runtime::CriO, id));
    }
    if let Some((_, rest)) = name.split_once(":docker:") {
        return container_id(rest).map(|id| (Runtime::Docker, id));
    }
    if let Some(n) = name.strip_prefix("lxc.payload.").filter(|n| !n.is_empty()) {
        return Some((Runtime::Lxc, n.to_owned()));
    }
    match parent {
        Some("docker") => container_id(name).map(|id| (Runtime::Docker, id)),
        Some("lxc" | "lxc.payload") if !name.is_empty() => Some((Runtime::Lxc, name.to_owned())),
        Some("libpod_parent") => {
            name.strip_prefix("libpod-").and_then(container_id).map(|id| (Runtime::Podman, id))
        }
        // kubepods cgroupfs layout: the container's parent is the pod cgroup.
        Some(p) if p.starts_with("pod") && pod_uid(p).is_some() => {
            container_id(name).map(|id| (Runtime::Kubernetes, id))
        }
        _ => None,
    }
}

/// The pod UID of a pod cgroup name: `pod<uid>` or `kubepods[-qos]-pod<uid>.slice` (systemd
/// escapes the UID's dashes as underscores).
fn pod_uid(name: &str) -> Option<String> {
    let raw = if let Some(slice) = name.strip_suffix(".slice") {
        // Also `kubelet-kubepods-…-pod<uid>.slice` (kind and other nested kubelets).
        &slice[slice.rfind("-pod")? + 4..]
    } else {
        name.strip_prefix("pod")?
    };
    let uid = raw.replace('_', "-");
    let ok = uid.len() >= 32 && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    ok.then(|| uid.to_ascii_lowercase())
}

fn qos_of(component: &str) -> Option<Qos> {
    if component.contains("besteffort") {
        Some(Qos::BestEffort)
    } else if component.contains("burstable") {
        Some(Qos::Burstable)
    } else {
        None
    }
}

/// The identity of a cgroup v2 path like `/system.slice/docker-<id>.scope`. None for plain
/// cgroups (root, user sessions, slices, hand-made cgroups).
pub fn parse(path: &str) -> Option<Identity> {
    let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let prefix = |n: usize| format!("/{}", parts[..n].join("/"));
    for i in (0..parts.len()).rev() {
        let parent = i.checked_sub(1).map(|p| parts[p]);
        let Some((runtime, id)) = component_container(parts[i], parent) else { continue };
        let mut pod = None;
        let mut qos = None;
        let mut in_kubepods = false;
        for &c in parts[..i].iter().rev() {
            if c.starts_with("kubepods") || c.starts_with("kubelet-kubepods") {
                in_kubepods = true;
            }
            if pod.is_none() && (c.starts_with("pod") || c.contains("-pod")) {
                pod = pod_uid(c);
            }
            qos = qos.or_else(|| if in_kubepods || pod.is_some() { qos_of(c) } else { None });
        }
        // In the `:cri-containerd:` form the pod slice is in the same component.
        if pod.is_none()
            && let Some((slice, _)) = parts[i].split_once(':')
        {
            pod = pod_uid(slice);
            qos = qos.or_else(|| qos_of(slice));
            in_kubepods |= slice.contains("kubepods");
        }
        if pod.is_some() || in_kubepods {
            qos = qos.or(Some(Qos::Guaranteed));
        } else {
            qos = None;
        }
        return Some(Identity {
            runtime,
            id,
            pod_uid: pod,
            qos,
            cgroup: path.to_owned(),
            container_cgroup: prefix(i + 1),
        });
    }
    // No container: the innermost systemd service, if any.
    let i = parts.iter().rposition(|c| c.ends_with(".service") && c.len() > ".service".len())?;
    Some(Identity {
        runtime: Runtime::Service,
        id: parts[i].to_owned(),
        pod_uid: None,
        qos: None,
        cgroup: path.to_owned(),
        container_cgroup: prefix(i + 1),
    })
}

/// The cgroup v2 path from the text of `/proc/PID/cgroup` (its `0::` line). None on hosts
/// without cgroup v2, where that line is missing.
pub fn v2_path_from_proc(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.strip_prefix("0::")).map(|p| p.trim_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f2a9c1b4e5d6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";

    struct Case {
        path: &'static str,
        want: Option<(Runtime, &'static str, Option<&'static str>, Option<Qos>)>,
    }

    fn c(
        path: &'static str,
        want: Option<(Runtime, &'static str, Option<&'static str>, Option<Qos>)>,
    ) -> Case {
        Case { path, want }
    }

    /// Paths as reported in runtime docs and bug reports (ids from those reports).
    #[test]
    fn real_world_paths() {
        use Qos::*;
        use Runtime::*;
        let cases = [
            // Docker, systemd driver (Fedora, moby/docker-gen#186).
            c(
                "/system.slice/docker-9b98bb265ea4c149d9a786380dd07716d341c3e925f2616040c6cd9ac8c4b75c.scope",
                Some((
                    Docker,
                    "9b98bb265ea4c149d9a786380dd07716d341c3e925f2616040c6cd9ac8c4b75c",
                    None,
                    None,
                )),
            ),
            // Docker, cgroupfs driver (moby/moby#33352).
            c(
                "/docker/5dace3de0735f73d2b5048f12d41a71741a02e49668de921fdae62f7e65dc498",
                Some((
                    Docker,
                    "5dace3de0735f73d2b5048f12d41a71741a02e49668de921fdae62f7e65dc498",
                    None,
                    None,
                )),
            ),
            // Rootless Docker (docker/docs#14545).
            c(
                "/user.slice/user-1000.slice/user@1000.service/user.slice/docker-2403ccfe427f1dc7b6120dccb9ac58c2f8456950380d587a9f33ea7f00dd303d.scope",
                Some((
                    Docker,
                    "2403ccfe427f1dc7b6120dccb9ac58c2f8456950380d587a9f33ea7f00dd303d",
                    None,
                    None,
                )),
            ),
            // containerd CRI, systemd driver, burstable pod (netdata/netdata#4868).
            c(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod55c6c714_b240_4dec_9a45_57b61696ab6e.slice/cri-containerd-2032491dcae31e6746f47daa0ac74564f2843a1bd847c5e6c4eb501ca132ac36.scope",
                Some((
                    Containerd,
                    "2032491dcae31e6746f47daa0ac74564f2843a1bd847c5e6c4eb501ca132ac36",
                    Some("55c6c714-b240-4dec-9a45-57b61696ab6e"),
                    Some(Burstable),
                )),
            ),
            // Static pod: the UID is a manifest hash without dashes.
            c(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod8daa50c3a64c9ff60bb9eab7b44b56fd.slice/cri-containerd-2884d57c0e100d7a9a2f9487ce0bc2986bca3430e988af7a4865aff061f51ac5.scope",
                Some((
                    Containerd,
                    "2884d57c0e100d7a9a2f9487ce0bc2986bca3430e988af7a4865aff061f51ac5",
                    Some("8daa50c3a64c9ff60bb9eab7b44b56fd"),
                    Some(Burstable),
                )),
            ),
            // Guaranteed pods sit right under kubepods.slice.
            c(
                "/kubepods.slice/kubepods-pod0125ec2f_b64a_4868_8f5b_94b56cbab864.slice/cri-containerd-ee4b20e90ac7f42a10bd004d05646b13d8ab5e2c5e7cbc01abf8006bac016459.scope",
                Some((
                    Containerd,
                    "ee4b20e90ac7f42a10bd004d05646b13d8ab5e2c5e7cbc01abf8006bac016459",
                    Some("0125ec2f-b64a-4868-8f5b-94b56cbab864"),
                    Some(Guaranteed),
                )),
            ),
            // kind: kubelet nested under kubelet.slice (containerd/nri#227).
            c(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod1e597579_417e_482f_bf65_5fe170c3aebd.slice/cri-containerd-d7dfb4a21fe1703a8537e60d5af248af729315d187b24a538102d14874c8117d.scope",
                Some((
                    Containerd,
                    "d7dfb4a21fe1703a8537e60d5af248af729315d187b24a538102d14874c8117d",
                    Some("1e597579-417e-482f-bf65-5fe170c3aebd"),
                    Some(BestEffort),
                )),
            ),
            // systemd driver names used as cgroupfs paths (opentelemetry-java#4507).
            c(
                "/kubepods-besteffort-pod0125ec2f_b64a_4868_8f5b_94b56cbab864.slice:cri-containerd:ee4b20e90ac7f42a10bd004d05646b13d8ab5e2c5e7cbc01abf8006bac016459",
                Some((
                    Containerd,
                    "ee4b20e90ac7f42a10bd004d05646b13d8ab5e2c5e7cbc01abf8006bac016459",
                    Some("0125ec2f-b64a-4868-8f5b-94b56cbab864"),
                    Some(BestEffort),
                )),
            ),
            // CRI-O (openshift/microshift#697, kubernetes/minikube#11280).
            c(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podc8bad552_5c99_4d4f_b71c_c426c0cde014.slice/crio-15b6e0c6490cad17fcf69eb837794349b4df96f84ba96c6be9828fe281c055a9.scope",
                Some((
                    CriO,
                    "15b6e0c6490cad17fcf69eb837794349b4df96f84ba96c6be9828fe281c055a9",
                    Some("c8bad552-5c99-4d4f-b71c-c426c0cde014"),
                    Some(BestEffort),
                )),
            ),
            // Kubernetes inside a Docker node container (minikube): innermost container wins.
            c(
                "/docker/d6701ec289c56e4391acb11d07474b3139466857a305490575508a8b7a9fcf22/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podae7a96fb_2bdc_46b0_96e2_78e4af94847b.slice/crio-89e8f450417b56acf3089925dfd8f050dd50e950e18cfe83ea923269df601102.scope",
                Some((
                    CriO,
                    "89e8f450417b56acf3089925dfd8f050dd50e950e18cfe83ea923269df601102",
                    Some("ae7a96fb-2bdc-46b0-96e2-78e4af94847b"),
                    Some(BestEffort),
                )),
            ),
            // CRI-O's conmon is in the pod but is not a container (cri-o via runc#4620).
            c(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod207aaad1_659f_4db8_88e0_46e0cdcc3004.slice/crio-conmon-32da98c8522068be05a7510a3eddb09cad6ed2f03286180d0e931d0d0b6224a6.scope",
                None,
            ),
            // Kubernetes, cgroupfs driver (local-cloud-csi-driver#4, kubernetes#36807).
            c(
                "/kubepods/besteffort/pod13e0457a-bb6a-4190-a67b-fd34cfb441c9/0c34bcd7d02f321d0df7aa6ea703285b02abebc9096c5128c14091fc43ea1f3b",
                Some((
                    Kubernetes,
                    "0c34bcd7d02f321d0df7aa6ea703285b02abebc9096c5128c14091fc43ea1f3b",
                    Some("13e0457a-bb6a-4190-a67b-fd34cfb441c9"),
                    Some(BestEffort),
                )),
            ),
            c(
                "/kubepods/pod13e0457a-bb6a-4190-a67b-fd34cfb441c9/0c34bcd7d02f321d0df7aa6ea703285b02abebc9096c5128c14091fc43ea1f3b",
                Some((
                    Kubernetes,
                    "0c34bcd7d02f321d0df7aa6ea703285b02abebc9096c5128c14091fc43ea1f3b",
                    Some("13e0457a-bb6a-4190-a67b-fd34cfb441c9"),
                    Some(Guaranteed),
                )),
            ),
            // Podman, systemd manager; crun's split `container` sub-cgroup (podman#13673).
            c(
                "/machine.slice/machine-libpod_pod_ddf44d54b520f0b4469fcd01c3155ca49e6911dc2175471eb3a7b789187a7a89.slice/libpod-1dadda571b14eefb3158a15d0fff7e0089f9dd92f922679ed0116cccdfe8bb0f.scope/container",
                Some((
                    Podman,
                    "1dadda571b14eefb3158a15d0fff7e0089f9dd92f922679ed0116cccdfe8bb0f",
                    None,
                    None,
                )),
            ),
            c(
                "/machine.slice/libpod-1dadda571b14eefb3158a15d0fff7e0089f9dd92f922679ed0116cccdfe8bb0f.scope",
                Some((
                    Podman,
                    "1dadda571b14eefb3158a15d0fff7e0089f9dd92f922679ed0116cccdfe8bb0f",
                    None,
                    None,
                )),
            ),
            // Podman, cgroupfs manager.
            c(
                "/libpod_parent/libpod-1dadda571b14eefb3158a15d0fff7e0089f9dd92f922679ed0116cccdfe8bb0f",
                Some((
                    Podman,
                    "1dadda571b14eefb3158a15d0fff7e0089f9dd92f922679ed0116cccdfe8bb0f",
                    None,
                    None,
                )),
            ),
            c(
                "/machine.slice/libpod-conmon-1dadda571b14eefb3158a15d0fff7e0089f9dd92f922679ed0116cccdfe8bb0f.scope",
                None,
            ),
            // LXC: old, 3.1+ and cgroup2 layouts (sysdig#1344, lxc#4376, lxc#2606).
            c("/lxc/web01", Some((Lxc, "web01", None, None))),
            c("/lxc.payload.a1", Some((Lxc, "a1", None, None))),
            c("/lxc.payload.a1/crond", Some((Lxc, "a1", None, None))),
            c("/lxc.payload/c1", Some((Lxc, "c1", None, None))),
            c("/lxc.monitor/c1", None),
            // systemd services; a service inside a container is the container's.
            c("/system.slice/ssh.service", Some((Service, "ssh.service", None, None))),
            c(
                "/system.slice/containerd.service",
                Some((Service, "containerd.service", None, None)),
            ),
            c(
                "/user.slice/user-1000.slice/user@1000.service/app.slice/app-gnome-firefox-1234.scope",
                Some((Service, "user@1000.service", None, None)),
            ),
            c(
                "/system.slice/docker-9b98bb265ea4c149d9a786380dd07716d341c3e925f2616040c6cd9ac8c4b75c.scope/system.slice/nginx.service",
                Some((
                    Docker,
                    "9b98bb265ea4c149d9a786380dd07716d341c3e925f2616040c6cd9ac8c4b75c",
                    None,
                    None,
                )),
            ),
            // Plain cgroups.
            c("/", None),
            c("", None),
            c("/user.slice/user-1000.slice/session-3.scope", None),
            c("/init.scope", None),
            c("/rsprof-test-1/work", None),
            // Malformed: empty or non-hex ids, too short, bare `.service`, stray slashes.
            c("/system.slice/docker-.scope", None),
            c("/system.slice/docker-zzzz2403ccfe427f.scope", None),
            c("/system.slice/docker-2403ccfe.scope", None),
            c("/docker/buildkit", None),
            c("/system.slice/.service", None),
            c("/lxc.payload.", None),
            c(
                "/kubepods/burstable/podnotauid/0c34bcd7d02f321d0df7aa6ea703285b02abebc9096c5128c14091fc43ea1f3b",
                None,
            ),
            c(
                "//system.slice//docker-9b98bb265ea4c149d9a786380dd07716d341c3e925f2616040c6cd9ac8c4b75c.scope/",
                Some((
                    Docker,
                    "9b98bb265ea4c149d9a786380dd07716d341c3e925f2616040c6cd9ac8c4b75c",
                    None,
                    None,
                )),
            ),
            // Upper-case hex is normalized.
            c(
                "/system.slice/docker-9B98BB265EA4C149D9A786380DD07716D341C3E925F2616040C6CD9AC8C4B75C.scope",
                Some((
                    Docker,
                    "9b98bb265ea4c149d9a786380dd07716d341c3e925f2616040c6cd9ac8c4b75c",
                    None,
                    None,
                )),
            ),
        ];
        let mut failures = Vec::new();
        for case in &cases {
            let got = parse(case.path);
            let got_t =
                got.as_ref().map(|i| (i.runtime, i.id.as_str(), i.pod_uid.as_deref(), i.qos));
            if got_t != case.want {
                failures.push(format!("{}\n   got  {got_t:?}\n   want {:?}", case.path, case.want));
            }
        }
        assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    }

    #[test]
    fn container_cgroup_is_the_containers_root() {
        let p = format!("/machine.slice/libpod-{ID}.scope/container");
        let i = parse(&p).unwrap();
        assert_eq!(i.container_cgroup, format!("/machine.slice/libpod-{ID}.scope"));
        assert_eq!(i.cgroup, p);
        let s = parse("/system.slice/ssh.service").unwrap();
        assert_eq!(s.container_cgroup, "/system.slice/ssh.service");
    }

    #[test]
    fn labels() {
        let d = parse(&format!("/system.slice/docker-{ID}.scope")).unwrap();
        assert_eq!(d.process_label().as_deref(), Some("[docker 3f2a9c1b]"));
        assert_eq!(d.to_string(), "docker 3f2a9c1b");
        let l = parse("/lxc/web01").unwrap();
        assert_eq!(l.process_label().as_deref(), Some("[lxc web01]"));
        assert_eq!(parse("/system.slice/ssh.service").unwrap().process_label(), None);
    }

    #[test]
    fn proc_cgroup_text() {
        let hybrid =
            "12:memory:/docker/abc\n1:name=systemd:/x\n0::/system.slice/containerd.service\n";
        assert_eq!(v2_path_from_proc(hybrid), Some("/system.slice/containerd.service"));
        assert_eq!(v2_path_from_proc("0::/\n"), Some("/"));
        assert_eq!(v2_path_from_proc("4:memory:/docker/abc\n"), None);
    }
}
