//! The checks of a plan that look past the configuration's own text: policy patterns
//! against the catalog, job executables on disk, what the unit's sandbox leaves writable,
//! and what the daemon's user can read and write (docs/design.md §9.4).

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::catalog::Snapshot;
use crate::config::{Config, ConfigIssue, KeySource};

/// Problems (the plan is refused) and warnings (printed, the plan stands).
#[derive(Debug, Default)]
pub struct Findings {
    pub errors: Vec<ConfigIssue>,
    pub warnings: Vec<ConfigIssue>,
}

impl Findings {
    fn error(&mut self, path: impl Into<String>, problem: impl Into<String>) {
        self.errors.push(issue(path, problem));
    }

    fn warn(&mut self, path: impl Into<String>, problem: impl Into<String>) {
        self.warnings.push(issue(path, problem));
    }
}

fn issue(path: impl Into<String>, problem: impl Into<String>) -> ConfigIssue {
    ConfigIssue {
        path: path.into(),
        problem: problem.into(),
        at: None,
    }
}

/// Who the daemon runs as, for access checks by mode bits.
#[derive(Debug, Clone)]
pub struct Subject {
    pub name: String,
    pub uid: u32,
    pub gids: BTreeSet<u32>,
}

impl Subject {
    /// The user `name` (or a numeric uid) with its primary and supplementary groups.
    pub fn lookup(name: &str) -> Result<Subject, String> {
        use nix::unistd::{Uid, User};
        let user = match name.parse::<u32>() {
            Ok(uid) => User::from_uid(Uid::from_raw(uid)),
            Err(_) => User::from_name(name),
        }
        .map_err(|e| format!("cannot look up user {name:?}: {e}"))?
        .ok_or_else(|| format!("there is no user {name:?}"))?;
        let cname = std::ffi::CString::new(user.name.clone())
            .map_err(|_| format!("user name {name:?} holds a NUL byte"))?;
        let groups = nix::unistd::getgrouplist(&cname, user.gid)
            .map_err(|e| format!("cannot list the groups of {name:?}: {e}"))?;
        Ok(Subject {
            name: user.name,
            uid: user.uid.as_raw(),
            gids: groups.into_iter().map(|g| g.as_raw()).collect(),
        })
    }

    /// Whether this subject may `want` (r = 4, w = 2, x = 1 bits) on a file with `meta`.
    fn may(&self, meta: &std::fs::Metadata, want: u32) -> bool {
        let mode = meta.permissions().mode();
        if self.uid == 0 {
            // Root reads and writes anything; it executes only what someone may.
            return want & 1 == 0 || meta.is_dir() || mode & 0o111 != 0;
        }
        let bits = if meta.uid() == self.uid {
            mode >> 6
        } else if self.gids.contains(&meta.gid()) {
            mode >> 3
        } else {
            mode
        };
        bits & want == want
    }

    /// Why this subject cannot `want` on `path` (every directory above it needs search),
    /// or `None` when it can.
    fn denied(&self, path: &Path, want: u32) -> Option<String> {
        let mut at = PathBuf::from("/");
        for component in path
            .parent()
            .into_iter()
            .flat_map(|p| p.components())
            .skip(1)
        {
            at.push(component);
            match std::fs::metadata(&at) {
                Ok(meta) if !self.may(&meta, 1) => {
                    return Some(format!(
                        "{} cannot enter {} (mode {:04o}, owner uid {}, group gid {})",
                        self.name,
                        at.display(),
                        meta.permissions().mode() & 0o7777,
                        meta.uid(),
                        meta.gid()
                    ));
                }
                Ok(_) => {}
                Err(e) => return Some(format!("cannot inspect {}: {e}", at.display())),
            }
        }
        match std::fs::metadata(path) {
            Ok(meta) if !self.may(&meta, want) => Some(format!(
                "{} cannot {} {} (mode {:04o}, owner uid {}, group gid {})",
                self.name,
                verb(want, meta.is_dir()),
                path.display(),
                meta.permissions().mode() & 0o7777,
                meta.uid(),
                meta.gid()
            )),
            Ok(_) => None,
            Err(e) => Some(format!("cannot inspect {}: {e}", path.display())),
        }
    }
}

fn verb(want: u32, dir: bool) -> &'static str {
    match (want, dir) {
        (w, true) if w & 2 != 0 => "create files in",
        (_, true) => "list",
        (w, false) if w & 1 != 0 => "execute",
        (w, false) if w & 2 != 0 => "write",
        _ => "read",
    }
}

/// What a systemd unit's sandbox leaves writable (`ProtectSystem=`, `ReadWritePaths=`,
/// `StateDirectory=`, `RuntimeDirectory=`, `ProtectHome=`, `PrivateTmp=`), from the unit
/// file and its drop-ins.
#[derive(Debug, Clone, Default)]
pub struct Sandbox {
    /// Where the settings were read (for messages).
    pub from: Vec<PathBuf>,
    pub protect_system: String,
    pub protect_home: String,
    pub private_tmp: bool,
    pub writable: Vec<PathBuf>,
    /// `ReadOnlyPaths=`, `InaccessiblePaths=`, `BindReadOnlyPaths=` and
    /// `TemporaryFileSystem=` paths: never writable, whatever else says.
    pub not_writable: Vec<PathBuf>,
    /// `User=`: who the service runs as.
    pub user: Option<String>,
}

impl Sandbox {
    /// The installed robota-mcpd unit and its drop-ins, if a unit is installed.
    pub fn installed() -> Option<Sandbox> {
        let unit = [
            "/etc/systemd/system",
            "/lib/systemd/system",
            "/usr/lib/systemd/system",
        ]
        .iter()
        .map(|dir| Path::new(dir).join("robota-mcpd.service"))
        .find(|p| p.is_file())?;
        Sandbox::read(&unit).ok()
    }

    /// `unit` and its drop-ins (`<unit>.d/*.conf` beside it, then
    /// `/etc/systemd/system/<unit>.d/*.conf`), later settings winning as systemd applies
    /// them.
    pub fn read(unit: &Path) -> Result<Sandbox, String> {
        let mut files = vec![unit.to_path_buf()];
        let Some(name) = unit.file_name() else {
            return Err(format!("{} names no unit file", unit.display()));
        };
        let dropins = format!("{}.d", name.to_string_lossy());
        let mut dirs = vec![unit.with_file_name(&dropins)];
        let etc = Path::new("/etc/systemd/system").join(&dropins);
        if !dirs.contains(&etc) {
            dirs.push(etc);
        }
        for dir in dirs {
            if let Ok(entries) = std::fs::read_dir(dir) {
                let mut found: Vec<PathBuf> = entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "conf"))
                    .collect();
                found.sort();
                files.extend(found);
            }
        }
        let mut sandbox = Sandbox::default();
        for file in files {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            sandbox.apply(&text);
            sandbox.from.push(file);
        }
        Ok(sandbox)
    }

    fn apply(&mut self, text: &str) {
        let mut in_service = false;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                in_service = line == "[Service]";
                continue;
            }
            let Some((key, value)) = line.split_once('=').filter(|_| in_service) else {
                continue;
            };
            let value = value.trim();
            match key.trim() {
                "ProtectSystem" => self.protect_system = value.to_owned(),
                "User" => self.user = Some(value.to_owned()).filter(|u| !u.is_empty()),
                "ProtectHome" => self.protect_home = value.to_owned(),
                "PrivateTmp" => self.private_tmp = matches!(value, "yes" | "true" | "1" | "on"),
                "ReadWritePaths" if value.is_empty() => self.writable.clear(),
                "ReadWritePaths" => self.writable.extend(paths(value)),
                "ReadOnlyPaths"
                | "InaccessiblePaths"
                | "BindReadOnlyPaths"
                | "TemporaryFileSystem" => self.not_writable.extend(paths(value)),
                "StateDirectory" => self.writable.extend(
                    value
                        .split_whitespace()
                        .map(|d| Path::new("/var/lib").join(d)),
                ),
                "RuntimeDirectory" => self
                    .writable
                    .extend(value.split_whitespace().map(|d| Path::new("/run").join(d))),
                _ => {}
            }
        }
    }

    fn strict(&self) -> bool {
        self.protect_system == "strict"
    }

    fn writable(&self, path: &Path) -> bool {
        let home = ["/home", "/root", "/run/user"]
            .iter()
            .any(|h| path.starts_with(h));
        if home && self.protect_home == "read-only" {
            return false;
        }
        if self.not_writable.iter().any(|p| path.starts_with(p)) {
            return false;
        }
        !self.strict() || self.writable.iter().any(|w| path.starts_with(w))
    }

    /// Why the unit hides `path` altogether, if it does.
    fn hidden(&self, path: &Path) -> Option<&'static str> {
        let home = ["/home", "/root", "/run/user"]
            .iter()
            .any(|h| path.starts_with(h));
        if home && matches!(self.protect_home.as_str(), "yes" | "true" | "tmpfs") {
            return Some("ProtectHome= makes /home, /root and /run/user empty for the service");
        }
        if self.private_tmp && (path.starts_with("/tmp") || path.starts_with("/var/tmp")) {
            return Some(
                "PrivateTmp=yes gives the service a /tmp and /var/tmp of its own: this directory is not what it sees",
            );
        }
        None
    }

    fn named(&self) -> String {
        self.from
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// The paths of a unit setting: space-separated, each maybe quoted, maybe prefixed `-`
/// (ignore if missing) or `+`, a `:options` suffix (`BindReadOnlyPaths=`,
/// `TemporaryFileSystem=`) dropped.
fn paths(value: &str) -> impl Iterator<Item = PathBuf> + '_ {
    value.split_whitespace().map(|p| {
        let p = p.trim_matches(['"', '\'']).trim_start_matches(['-', '+']);
        PathBuf::from(p.split(':').next().unwrap_or(p))
    })
}

/// Every check of this module over a configuration and the catalog it builds.
pub fn run(
    config: &Config,
    snapshot: &Snapshot,
    subject: Option<&Subject>,
    sandbox: Option<&Sandbox>,
) -> Findings {
    let mut found = Findings::default();
    policy_patterns(config, snapshot, &mut found);
    jobs(config, subject, &mut found);
    writable_now(config, &mut found);
    if let Some(sandbox) = sandbox {
        sandboxed(config, sandbox, &mut found);
    }
    if let Some(subject) = subject {
        access(config, subject, &mut found);
        new_file_groups(config, subject, &mut found);
    }
    polkit(config, subject, Path::new(POLKIT_SERVICE), &mut found);
    found
}

/// A confined upstream's `read_paths` and `write_paths` against what the daemon keeps to
/// itself (`kept`): the launcher carves kept paths out of every grant, so a grant that
/// lies in one gives nothing, and one that holds one is granted entry by entry as the
/// child starts — both surprise whoever wrote the list.
pub fn kept_out_of_grants(config: &Config, kept: &[PathBuf], found: &mut Findings) {
    use crate::config::UpstreamEndpoint;
    use crate::upstream::confine::canonical as resolved;
    let kept: Vec<(&PathBuf, PathBuf)> = kept.iter().map(|k| (k, resolved(k))).collect();
    let confined = config.upstreams.iter().any(
        |u| matches!(&u.endpoint, UpstreamEndpoint::Command { confine, .. } if confine.enabled),
    );
    for (given, _) in kept.iter().filter(|_| confined) {
        if let Some(why) = crate::upstream::confine::movable_by_others(given) {
            found.warn(
                "upstreams",
                format!(
                    "no confined upstream will start: it cannot be kept from {}, since {why}",
                    given.display()
                ),
            );
        }
    }
    for upstream in &config.upstreams {
        let UpstreamEndpoint::Command { confine, .. } = &upstream.endpoint else {
            continue;
        };
        if !confine.enabled {
            continue;
        }
        for (list, paths) in [
            ("read_paths", &confine.read_paths),
            ("write_paths", &confine.write_paths),
        ] {
            for (i, given) in paths.iter().enumerate() {
                let key = format!("upstreams.{}.{list}[{i}]", upstream.name);
                let path = resolved(given);
                let spelt = if &path == given {
                    given.display().to_string()
                } else {
                    format!("{} (a link to {})", given.display(), path.display())
                };
                if let Some((k, _)) = kept.iter().find(|(_, k)| path.starts_with(k)) {
                    found.warn(
                        key,
                        format!(
                            "{spelt} lies in {}, which the daemon keeps to itself: the upstream is given nothing of it",
                            k.display()
                        ),
                    );
                } else if let Some((k, _)) = kept.iter().find(|(_, k)| k.starts_with(&path)) {
                    found.warn(
                        key,
                        format!(
                            "{spelt} holds {}, which the daemon keeps to itself: it stays out of the upstream's reach, and the directories on the way to it are granted entry by entry as the upstream starts (nothing can be made directly in them; what appears in them later is reachable only after a restart); grant a directory beside the daemon's instead",
                            k.display()
                        ),
                    );
                }
            }
        }
    }
}

/// The D-Bus activation file `polkitd` installs.
const POLKIT_SERVICE: &str = "/usr/share/dbus-1/system-services/org.freedesktop.PolicyKit1.service";

/// `service.action` as a user other than root is authorised by polkit: without `polkitd`
/// systemd refuses every job (`AccessDenied`, after the job was asked for).
fn polkit(config: &Config, subject: Option<&Subject>, activation: &Path, found: &mut Findings) {
    let as_root = subject.is_some_and(|s| s.uid == 0);
    if config.tools.service.units.is_empty() || as_root || activation.exists() {
        return;
    }
    found.warn(
        "tools.service.units",
        format!(
            "polkitd is not installed ({} is missing): systemd will refuse every \
             service.action of the daemon's user with AccessDenied; install it (apt install \
             polkitd) and the rule in packaging/README.md, or leave service.* to \
             service.status",
            activation.display()
        ),
    );
}

/// A `[[policy]]` tool pattern that matches no tool is an error (a `deny` that never
/// matches leaves the tool allowed); a caller pattern that can match no caller is an
/// error, one that looks like a typo of the host bearer a warning.
fn policy_patterns(config: &Config, snapshot: &Snapshot, found: &mut Findings) {
    let mut names: Vec<&str> = snapshot.specs().map(|s| s.name.as_str()).collect();
    names.push(snapshot.submission().name.as_str());
    for (i, rule) in config.policy.iter().enumerate() {
        for (j, pattern) in rule.tools.iter().enumerate() {
            // An upstream's tools are known only once it runs: a pattern under its prefix
            // may match them.
            let upstream = config.upstreams.iter().any(|u| {
                let prefix = format!("{}.", u.name);
                pattern.starts_with(&prefix)
                    || glob_match::glob_match(pattern, &format!("{prefix}x"))
            });
            if !upstream && !names.iter().any(|n| glob_match::glob_match(pattern, n)) {
                let hint = closest(pattern, &names)
                    .map(|n| format!("; did you mean {n:?}?"))
                    .unwrap_or_default();
                found.error(
                    format!("policy[{i}].tools[{j}]"),
                    format!(
                        "{pattern:?} matches no tool of the catalog, so this rule never applies{hint}"
                    ),
                );
            }
        }
        for (j, pattern) in rule.callers.iter().enumerate() {
            let key = format!("policy[{i}].callers[{j}]");
            let kind = pattern.split_once(':').map(|(k, _)| k);
            match kind {
                Some("local" | "bearer" | "oauth") => {}
                _ if pattern.starts_with('*') => {}
                _ => {
                    found.error(
                        key,
                        format!(
                            "{pattern:?} can match no caller: callers are local:<uid>, bearer:<label> or oauth:<client>/<subject>"
                        ),
                    );
                    continue;
                }
            }
            if let Some(label) = pattern.strip_prefix("bearer:")
                && label != "default"
                && !label.contains(['*', '?', '['])
                && distance(label, "default") <= 2
            {
                found.warn(
                    key,
                    format!(
                        "{pattern:?} matches only a bearer labelled {label:?}; did you mean \"bearer:default\" (the host bearer)?"
                    ),
                );
            } else if let Some(uid) = pattern.strip_prefix("local:")
                && !uid.contains(['*', '?', '['])
                && uid.parse::<u32>().is_err()
            {
                found.error(
                    key,
                    format!(
                        "{pattern:?} can match no caller: a local caller is local:<numeric uid>"
                    ),
                );
            }
        }
    }
}

/// Every job template's executable exists, is a regular file and is executable.
fn jobs(config: &Config, subject: Option<&Subject>, found: &mut Findings) {
    for (name, job) in &config.tools.jobs {
        let Some(program) = job.argv.first() else {
            continue;
        };
        let key = format!("jobs.{name}.argv[0]");
        let path = Path::new(program);
        if !path.is_absolute() {
            found.error(key, format!("{program:?} is not an absolute path"));
            continue;
        }
        match std::fs::metadata(path) {
            Err(e) => found.error(key, format!("{program}: {e}")),
            Ok(meta) if !meta.is_file() => found.error(key, format!("{program} is not a file")),
            Ok(meta) if meta.permissions().mode() & 0o111 == 0 => {
                found.error(key, format!("{program} is not executable"))
            }
            Ok(_) => {
                if let Some(why) = subject.and_then(|s| s.denied(path, 1)) {
                    found.error(key, why);
                }
            }
        }
        if let Some(dir) = &job.working_dir
            && !dir.is_dir()
        {
            found.error(
                format!("jobs.{name}.working_dir"),
                format!("{} is not a directory", dir.display()),
            );
        }
    }
}

/// The write roots as this process finds them now: a read-only mount (the unit's
/// `ProtectSystem=strict` without a `ReadWritePaths=` for it) is found at start.
fn writable_now(config: &Config, found: &mut Findings) {
    use nix::unistd::{AccessFlags, faccessat};
    for (i, root) in config.tools.file.write_roots.iter().enumerate() {
        let can = faccessat(
            nix::fcntl::AT_FDCWD,
            root,
            AccessFlags::W_OK | AccessFlags::X_OK,
            nix::fcntl::AtFlags::AT_EACCESS,
        );
        match can {
            Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
            Err(nix::errno::Errno::EROFS) => found.error(
                format!("tools.file.write_roots[{i}]"),
                format!(
                    "{} is on a read-only file system for this process (under systemd: add ReadWritePaths={} in a drop-in)",
                    root.display(),
                    root.display()
                ),
            ),
            Err(e) => found.error(
                format!("tools.file.write_roots[{i}]"),
                format!("{} cannot be written by this process: {}", root.display(), e.desc()),
            ),
        }
    }
}

/// Paths the daemon writes must be writable under the unit's sandbox; paths it reads
/// must not be hidden by it.
fn sandboxed(config: &Config, sandbox: &Sandbox, found: &mut Findings) {
    let unit = sandbox.named();
    for (i, root) in config.tools.file.write_roots.iter().enumerate() {
        let key = format!("tools.file.write_roots[{i}]");
        if let Some(why) = sandbox.hidden(root) {
            found.error(key, format!("{}: {why} ({unit})", root.display()));
        } else if !sandbox.writable(root) {
            found.error(
                key,
                format!(
                    "{} is read-only for the service: {unit} has ProtectSystem=strict and no ReadWritePaths= covering it; add a drop-in (systemctl edit robota-mcpd) with ReadWritePaths={}",
                    root.display(),
                    root.display()
                ),
            );
        }
    }
    for (i, root) in config.tools.file.read_roots.iter().enumerate() {
        if let Some(why) = sandbox.hidden(root) {
            found.error(
                format!("tools.file.read_roots[{i}]"),
                format!("{}: {why} ({unit})", root.display()),
            );
        }
    }
    for upstream in &config.upstreams {
        upstream_sandboxed(upstream, sandbox, &unit, found);
    }
    if !sandbox.writable(&config.state_dir) {
        found.error(
            "daemon.state_dir",
            format!(
                "{} is read-only for the service: {unit} has ProtectSystem=strict and no ReadWritePaths= or StateDirectory= covering it",
                config.state_dir.display()
            ),
        );
    }
}

/// An upstream's paths under the unit's sandbox: its executable, working directory,
/// socket or bearer file hidden is an error (it cannot start or connect); an absolute path
/// among its arguments that the unit hides is an error too, and a directory among them
/// that it makes read-only a warning (a server that writes there fails at its first
/// write).
fn upstream_sandboxed(
    upstream: &crate::config::UpstreamConfig,
    sandbox: &Sandbox,
    unit: &str,
    found: &mut Findings,
) {
    use crate::config::{HttpTarget, UpstreamEndpoint};
    let name = &upstream.name;
    let mut hidden = |key: String, path: &Path| {
        if let Some(why) = sandbox.hidden(path) {
            found.error(key, format!("{}: {why} ({unit})", path.display()));
            true
        } else {
            false
        }
    };
    match &upstream.endpoint {
        UpstreamEndpoint::Command { argv, cwd, .. } => {
            if let Some(dir) = cwd {
                hidden(format!("upstreams.{name}.cwd"), dir);
            }
            let mut read_only = Vec::new();
            for (i, arg) in argv.iter().enumerate() {
                // `--root=/home/x` as well as `/home/x`.
                let path = Path::new(arg.rsplit_once('=').map_or(arg.as_str(), |(_, p)| p));
                if !path.is_absolute() {
                    continue;
                }
                let key = format!("upstreams.{name}.command[{i}]");
                // A directory argument is likely what the server serves (a script or a
                // data file is only read).
                if !hidden(key.clone(), path) && i > 0 && path.is_dir() && !sandbox.writable(path) {
                    read_only.push((key, path.to_owned()));
                }
            }
            for (key, path) in read_only {
                found.warn(
                    key,
                    format!(
                        "{} is read-only for the service ({unit} has ProtectSystem=strict): a server that writes there fails; if it should, add ReadWritePaths={} in a drop-in (systemctl edit robota-mcpd)",
                        path.display(),
                        path.display()
                    ),
                );
            }
        }
        UpstreamEndpoint::Http {
            target,
            bearer_file,
            ..
        } => {
            if let HttpTarget::Unix(socket) = target {
                hidden(format!("upstreams.{name}.url"), socket);
            }
            if let Some(file) = bearer_file {
                hidden(format!("upstreams.{name}.bearer_file"), file);
            }
        }
    }
}

/// What the daemon's user must be able to read, write or enter.
fn access(config: &Config, subject: &Subject, found: &mut Findings) {
    let (r, w, x) = (4, 2, 1);
    let mut need = |key: String, path: &Path, want: u32| {
        if let Some(why) = subject.denied(path, want) {
            found.error(key, why);
        }
    };
    for (i, root) in config.tools.file.read_roots.iter().enumerate() {
        need(format!("tools.file.read_roots[{i}]"), root, r | x);
    }
    for (i, root) in config.tools.file.write_roots.iter().enumerate() {
        need(format!("tools.file.write_roots[{i}]"), root, r | w | x);
    }
    // The state directory, or the nearest directory above it that exists (it is created).
    let mut state = config.state_dir.as_path();
    while !state.exists() {
        match state.parent() {
            Some(parent) => state = parent,
            None => break,
        }
    }
    if subject.denied(state, w | x).is_some() {
        need("daemon.state_dir".into(), state, w | x);
    } else {
        for name in ["robota.db", "audit.jsonl", "jwks-cache.json"] {
            let file = config.state_dir.join(name);
            if file.exists() {
                need("daemon.state_dir".into(), &file, r | w);
            }
        }
    }
    if let Some(remote) = &config.remote {
        if let Some(tls) = &remote.tls {
            need("remote.tls.cert".into(), &tls.cert, r);
            need("remote.tls.key".into(), &tls.key, r);
        }
        if let Some(ca) = &remote.ca_file {
            need("remote.ca_file".into(), ca, r);
        }
        if let KeySource::JwksFile(file) = &remote.keys {
            need("remote.jwks_file".into(), file, r);
        }
    }
    if let Some(program) = config
        .session
        .turn
        .as_ref()
        .and_then(|t| t.argv.first())
        .filter(|p| p.starts_with('/'))
    {
        need("session.turn.argv[0]".into(), Path::new(program), x);
    }
}

/// The secrets the daemon reads at start, read here the same way (owner, mode, one line
/// of text) as the daemon's user, so that a file `check-config` passes cannot fail the
/// start. The secret itself is dropped at once, and no problem shows it.
pub fn secret_files(config: &Config, subject: Option<&Subject>, found: &mut Findings) {
    let Some(introspection) = config
        .remote
        .as_ref()
        .and_then(|r| r.introspection.as_ref())
    else {
        return;
    };
    let key = "remote.introspection.client_secret_file";
    let file = &introspection.client_secret_file;
    if let Some(why) = subject.and_then(|s| s.denied(file, 4)) {
        found.error(key, why);
        return;
    }
    let uid = subject.map_or_else(|| nix::unistd::geteuid().as_raw(), |s| s.uid);
    if let Err(e) = crate::oauth::introspect::read_secret_file(file, uid) {
        found.error(key, crate::error_chain(&e));
    }
}

/// The groups new files are given must be the daemon's user's.
fn new_file_groups(config: &Config, subject: &Subject, found: &mut Findings) {
    for (root, made) in &config.tools.file.new_files {
        if let Some(gid) = made.gid
            && subject.uid != 0
            && !subject.gids.contains(&gid)
        {
            found.error(
                format!("tools.file.new_files.\"{}\".group", root.display()),
                format!(
                    "{} is not a member of group {gid}, so new files cannot be given it",
                    subject.name
                ),
            );
        }
    }
}

/// The name of `names` closest to `pattern`, when it is close (a typo).
fn closest<'a>(pattern: &str, names: &[&'a str]) -> Option<&'a str> {
    names
        .iter()
        .map(|n| (distance(pattern, n), *n))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, n)| n)
}

/// Levenshtein distance, for suggestions.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut above: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut row = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            row[j + 1] = (above[j] + cost).min(above[j + 1] + 1).min(row[j] + 1);
        }
        above = row;
    }
    above[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typos_are_close_and_strangers_are_not() {
        assert_eq!(distance("file.reed", "file.read"), 1);
        assert_eq!(distance("defualt", "default"), 2);
        assert_eq!(
            closest("file.reed", &["file.read", "file.write"]),
            Some("file.read")
        );
        assert_eq!(closest("docker.*x", &["file.read"]), None);
    }

    #[test]
    fn a_unit_and_its_drop_in_decide_what_is_writable() {
        let mut sandbox = Sandbox::default();
        sandbox.apply(
            "[Unit]\nReadWritePaths=/ignored\n[Service]\nProtectSystem=strict\nProtectHome=yes\nPrivateTmp=yes\nStateDirectory=robota-mcpd\n",
        );
        sandbox.apply("[Service]\nReadWritePaths=/srv/app -/srv/optional\n");
        assert!(sandbox.writable(Path::new("/var/lib/robota-mcpd")));
        assert!(sandbox.writable(Path::new("/srv/app/data")));
        assert!(sandbox.writable(Path::new("/srv/optional")));
        assert!(!sandbox.writable(Path::new("/srv/other")));
        assert!(!sandbox.writable(Path::new("/ignored")));
        assert!(sandbox.hidden(Path::new("/home/app")).is_some());
        assert!(sandbox.hidden(Path::new("/tmp/x")).is_some());
        assert!(sandbox.hidden(Path::new("/srv/app")).is_none());
        // Narrower settings win over a ReadWritePaths= above them; quotes are read.
        sandbox.apply(
            "[Service]\nReadOnlyPaths=/srv/app/ro\nBindReadOnlyPaths=-/srv/app/bound:/x\nReadWritePaths=\"/srv/quoted\"\nProtectHome=read-only\n",
        );
        assert!(!sandbox.writable(Path::new("/srv/app/ro/x")));
        assert!(!sandbox.writable(Path::new("/srv/app/bound")));
        assert!(sandbox.writable(Path::new("/srv/app/other")));
        assert!(sandbox.writable(Path::new("/srv/quoted")));
        assert!(!sandbox.writable(Path::new("/home/app")));
    }

    #[test]
    fn mode_bits_decide_for_owner_group_and_others() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let meta = std::fs::metadata(&file).unwrap();
        let owner = Subject {
            name: "owner".into(),
            uid: meta.uid(),
            gids: BTreeSet::new(),
        };
        let member = Subject {
            name: "member".into(),
            uid: 4242,
            gids: [meta.gid()].into(),
        };
        let stranger = Subject {
            name: "stranger".into(),
            uid: 4243,
            gids: [4243].into(),
        };
        assert!(owner.may(&meta, 4 | 2));
        assert!(member.may(&meta, 4) && !member.may(&meta, 2));
        assert!(!stranger.may(&meta, 4));
        let why = stranger.denied(&file, 4).expect("denied");
        assert!(why.contains("stranger cannot read"), "{why}");
    }
}
