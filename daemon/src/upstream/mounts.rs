//! The mount table (`/proc/self/mountinfo`): where each filesystem's parts are mounted.
//! The cgroup hierarchies are found in it, and the confinement reads it to find every
//! other place a path the daemon keeps to itself can be reached by (a bind mount of it,
//! or of a directory above or below it).

use std::path::{Path, PathBuf};

/// One line of the mount table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// `major:minor` of the filesystem.
    pub device: String,
    /// The directory of that filesystem mounted here.
    pub root: PathBuf,
    /// Where it is mounted.
    pub at: PathBuf,
    pub fstype: String,
    /// The filesystem's own options (for a v1 cgroup hierarchy, its controllers).
    pub super_options: String,
}

/// The calling process's mount table.
pub fn read() -> Result<Vec<Mount>, String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|text| parse(&text))
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))
}

/// `id parent major:minor root mount-point options [optional…] - fstype source
/// super-options`, one mount a line; lines that do not read so are skipped.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            Some(Mount {
                device: (*left.get(2)?).to_owned(),
                root: unescape(left.get(3)?).into(),
                at: unescape(left.get(4)?).into(),
                fstype: (*right.first()?).to_owned(),
                super_options: (*right.get(2).unwrap_or(&"")).to_owned(),
            })
        })
        .collect()
}

/// The kernel writes a space, tab, line feed and backslash in a path as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |n, c| n * 8 + u32::from(c - b'0')));
        match octal.and_then(|n| u8::try_from(n).ok()) {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every path `path` (absolute, its links resolved) can be reached by through `mounts`:
/// itself; for each mount of the same filesystem whose mounted directory holds it, the
/// same place beneath that mount; each mount whose mounted directory lies beneath it (all
/// of that mount is a part of `path`); and the same through an overlay's layers.
pub fn aliases(path: &Path, mounts: &[Mount]) -> Vec<PathBuf> {
    let mut found = vec![path.to_owned()];
    // The mount `path` is on: the deepest mount point above it (of stacked mounts, the
    // last, which is the one seen).
    let Some(holder) = mounts
        .iter()
        .filter(|m| path.starts_with(&m.at))
        .max_by_key(|m| m.at.components().count())
    else {
        return found;
    };
    if let Ok(below) = path.strip_prefix(&holder.at) {
        let inside = holder.root.join(below);
        found.extend(
            mounts
                .iter()
                .filter(|m| m.device == holder.device)
                .filter_map(|m| shown_at(&inside, &m.root, &m.at)),
        );
    }
    // An overlay shows its layers' files (read, and copied up when written) at its own
    // mount point. A layer is named as its mounter spelled it: resolved here where it
    // can be (links, `..`) and compared with every place `path` shows; where it cannot be
    // (a relative path, one under /proc naming the mounter's own descriptors), the
    // overlay is taken to hold `path` — unless `path` lies on it (a container's root,
    // whose layers are its host's): then it is the way to `path`, not a second one.
    let mut overlays = Vec::new();
    for m in mounts.iter().filter(|m| m.fstype == "overlay") {
        for layer in overlay_layers(&m.super_options) {
            if !layer.is_absolute() || layer.starts_with("/proc") {
                if !path.starts_with(&m.at) {
                    overlays.push(m.at.clone());
                }
                continue;
            }
            let layer = std::fs::canonicalize(&layer).unwrap_or(layer);
            overlays.extend(
                found
                    .iter()
                    .filter_map(|seen| shown_at(seen, &layer, &m.at)),
            );
        }
    }
    found.extend(overlays);
    found.sort();
    found.dedup();
    found
}

/// Where `target` shows when the directory `source` is shown at `at`: beneath `at` when
/// `source` holds it, all of `at` when `target` holds `source`.
fn shown_at(target: &Path, source: &Path, at: &Path) -> Option<PathBuf> {
    match target.strip_prefix(source) {
        Ok(rest) if rest.as_os_str().is_empty() => Some(at.to_owned()),
        Ok(rest) => Some(at.join(rest)),
        Err(_) if source.starts_with(target) => Some(at.to_owned()),
        Err(_) => None,
    }
}

/// The directories an overlay's options name as its layers, as spelt (`lowerdir=a:b`, `upperdir=`;
/// a `\` escapes the next character).
fn overlay_layers(options: &str) -> Vec<PathBuf> {
    let mut layers = Vec::new();
    let (mut current, mut key, mut escaped) = (String::new(), None::<String>, false);
    let mut end = |key: &Option<String>, current: &mut String| {
        if matches!(
            key.as_deref(),
            Some("lowerdir" | "upperdir" | "lowerdir+" | "datadir+")
        ) && !current.is_empty()
        {
            layers.push(PathBuf::from(current.as_str()));
        }
        current.clear();
    };
    for c in options.chars() {
        match c {
            _ if escaped => {
                current.push(c);
                escaped = false;
            }
            '\\' => escaped = true,
            '=' if key.is_none() => key = Some(std::mem::take(&mut current)),
            ':' if key.is_some() => end(&key, &mut current),
            ',' => {
                end(&key, &mut current);
                key = None;
            }
            _ => current.push(c),
        }
    }
    end(&key, &mut current);
    layers
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate
31 22 0:27 / /sys/fs/cgroup/memory rw shared:10 - cgroup cgroup rw,memory
40 22 8:1 /var/lib/robota-mcpd /srv/alias rw,relatime shared:1 - ext4 /dev/vda rw
41 22 8:1 /var/lib /mnt/var\\040lib rw,relatime shared:1 - ext4 /dev/vda rw
42 22 8:1 /var/lib/robota-mcpd/audit /opt/audit rw,relatime shared:1 - ext4 /dev/vda rw
43 22 8:17 / /data rw,relatime shared:2 - ext4 /dev/vdb rw
44 22 8:17 /lib /var/lib rw,relatime shared:2 - ext4 /dev/vdb rw
malformed line
";

    #[test]
    fn the_table_reads_with_its_escapes() {
        let mounts = parse(TABLE);
        assert_eq!(mounts.len(), 8);
        assert_eq!(mounts[2].fstype, "cgroup");
        assert_eq!(mounts[2].super_options, "rw,memory");
        assert_eq!(mounts[4].at, Path::new("/mnt/var lib"));
        assert_eq!(unescape(r"a\134b\011c\12"), "a\\b\tc\\12");
    }

    #[test]
    fn an_overlay_shows_its_layers() {
        assert_eq!(
            overlay_layers(r"rw,lowerdir=/a\:b:/var/lib,upperdir=/up,workdir=/work,xino=off"),
            [
                PathBuf::from("/a:b"),
                PathBuf::from("/var/lib"),
                PathBuf::from("/up")
            ]
        );
        let mounts = parse(
            "22 1 8:1 / / rw - ext4 /dev/vda rw\n\
             50 22 0:40 / /srv/ovl rw - overlay overlay rw,lowerdir=/var/lib,upperdir=/u,workdir=/w\n\
             51 22 0:41 / /srv/in rw - overlay overlay rw,lowerdir=/var/lib/robota-mcpd/x,upperdir=/u2,workdir=/w2\n\
             52 22 8:1 /var/lib/robota-mcpd /srv/bound rw - ext4 /dev/vda rw\n\
             53 22 0:42 / /srv/via-bind rw - overlay overlay rw,lowerdir=/srv/bound,upperdir=/u3,workdir=/w3\n\
             54 22 0:43 / /srv/relative rw - overlay overlay rw,lowerdir=state,upperdir=/u4,workdir=/w4\n\
             55 22 0:44 / /srv/fd rw - overlay overlay rw,lowerdir=/proc/self/fd/3,upperdir=/u5,workdir=/w5\n\
             56 22 0:45 / /srv/other rw - overlay overlay rw,lowerdir=/usr/share,upperdir=/u6,workdir=/w6\n",
        );
        let mut found = aliases(Path::new("/var/lib/robota-mcpd"), &mounts);
        found.sort();
        assert_eq!(
            found,
            [
                PathBuf::from("/srv/bound"),
                PathBuf::from("/srv/fd"),
                PathBuf::from("/srv/in"),
                PathBuf::from("/srv/ovl/robota-mcpd"),
                PathBuf::from("/srv/relative"),
                PathBuf::from("/srv/via-bind"),
                PathBuf::from("/var/lib/robota-mcpd")
            ]
        );
    }

    #[test]
    fn a_containers_root_overlay_is_the_way_to_what_lies_on_it() {
        // Its layers are the host's, named relative to where the host mounted them.
        let mounts = parse(
            "22 1 0:46 / / rw - overlay overlay rw,lowerdir=l/ABC:l/DEF,upperdir=/u,workdir=/w\n",
        );
        assert_eq!(
            aliases(Path::new("/var/lib/robota-mcpd"), &mounts),
            [PathBuf::from("/var/lib/robota-mcpd")]
        );
    }

    #[test]
    fn a_kept_path_is_reached_through_every_bind_mount_of_it_above_or_below() {
        // /var/lib is itself a mount (8:17's /lib), so the state directory lives on 8:17,
        // reachable also at /data/lib/robota-mcpd; 8:1's binds are another filesystem's.
        let mounts = parse(TABLE);
        let mut found = aliases(Path::new("/var/lib/robota-mcpd"), &mounts);
        found.sort();
        assert_eq!(
            found,
            [
                PathBuf::from("/data/lib/robota-mcpd"),
                PathBuf::from("/var/lib/robota-mcpd")
            ]
        );
        // Without that mount, the root filesystem's binds: the directory itself, a
        // directory above it, and one below it.
        let flat: Vec<Mount> = mounts.into_iter().filter(|m| m.device != "8:17").collect();
        let mut found = aliases(Path::new("/var/lib/robota-mcpd"), &flat);
        found.sort();
        assert_eq!(
            found,
            [
                PathBuf::from("/mnt/var lib/robota-mcpd"),
                PathBuf::from("/opt/audit"),
                PathBuf::from("/srv/alias"),
                PathBuf::from("/var/lib/robota-mcpd"),
            ]
        );
    }
}
