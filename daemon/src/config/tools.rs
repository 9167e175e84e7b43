//! `[tools.*]` and `[jobs.<name>]`: what the host tools may touch and which jobs exist.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{DurationText, Issues, SizeText};

/// Default and ceiling of one `file.read` / `file.write` payload.
pub const FILE_BYTES_DEFAULT: u64 = 4 * 1024 * 1024;
pub const FILE_BYTES_CEILING: u64 = 32 * 1024 * 1024;
/// Default and ceiling of what one job keeps of its output.
pub const JOB_OUTPUT_DEFAULT: u64 = 1024 * 1024;
pub const JOB_OUTPUT_CEILING: u64 = 64 * 1024 * 1024;

/// Everything the host tools are allowed to reach.
#[derive(Debug, Clone, Default)]
pub struct ToolsConfig {
    pub file: FileTool,
    pub service: ServiceTool,
    pub docker: DockerTool,
    pub permissions: PermissionsTool,
    /// Job templates by name (`job.start {"template": name}`).
    pub jobs: BTreeMap<String, JobTemplate>,
    /// Jobs running at once; one more start is answered `busy`.
    pub max_running_jobs: usize,
}

/// `[tools.file]`: roots are absolute directories; write roots are readable too.
#[derive(Debug, Clone)]
pub struct FileTool {
    pub read_roots: Vec<PathBuf>,
    pub write_roots: Vec<PathBuf>,
    /// Largest `file.read` length and largest file `file.read` hashes.
    pub max_read: u64,
    /// Largest content `file.write` accepts, and largest file it appends to.
    pub max_write: u64,
    /// How `file.write` makes a new file under each write root (by root path).
    pub new_files: BTreeMap<PathBuf, NewFiles>,
}

/// `[tools.file.new_files."<write root>"]`: a new file's permission bits and group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewFiles {
    pub mode: u32,
    /// `None`: the group of the directory the file is made in.
    pub gid: Option<u32>,
}

/// The permission bits of a new file when its root sets none: readable by everyone who
/// may enter the directory, as a file made under the usual umask 022 is.
pub const NEW_FILE_MODE_DEFAULT: u32 = 0o644;

impl Default for NewFiles {
    fn default() -> Self {
        Self {
            mode: NEW_FILE_MODE_DEFAULT,
            gid: None,
        }
    }
}

impl Default for FileTool {
    fn default() -> Self {
        Self {
            read_roots: Vec::new(),
            write_roots: Vec::new(),
            max_read: FILE_BYTES_DEFAULT,
            max_write: FILE_BYTES_DEFAULT,
            new_files: BTreeMap::new(),
        }
    }
}

/// `[tools.service]`: unit name globs the service tools may see and act on.
#[derive(Debug, Clone)]
pub struct ServiceTool {
    pub units: Vec<String>,
    /// How long a start/stop/restart/reload job waits for systemd's job to finish.
    pub timeout: Duration,
}

impl Default for ServiceTool {
    fn default() -> Self {
        Self {
            units: Vec::new(),
            timeout: Duration::from_secs(90),
        }
    }
}

/// `[tools.docker]`: the Engine API socket and container name globs.
#[derive(Debug, Clone)]
pub struct DockerTool {
    pub socket: PathBuf,
    pub containers: Vec<String>,
    /// How long a start/stop/restart job may take.
    pub timeout: Duration,
}

impl Default for DockerTool {
    fn default() -> Self {
        Self {
            socket: PathBuf::from("/run/docker.sock"),
            containers: Vec::new(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// `[tools.permissions]`: bounds on grants.
#[derive(Debug, Clone)]
pub struct PermissionsTool {
    /// Longest duration a grant may be requested or approved for.
    pub max_duration: Duration,
    /// Pending requests a caller may have at once.
    pub max_pending: usize,
    /// How long an approval of one exact call (`approve-each`) stays usable once
    /// approved, unless the operator gives another duration.
    pub approval_expiry: Duration,
}

impl Default for PermissionsTool {
    fn default() -> Self {
        Self {
            max_duration: Duration::from_secs(24 * 3600),
            max_pending: 8,
            approval_expiry: Duration::from_secs(15 * 60),
        }
    }
}

/// `[jobs.<name>]`: a fixed command; callers choose the template, never the argv.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobTemplate {
    pub name: String,
    pub argv: Vec<String>,
    /// The job's whole environment (nothing is inherited from the daemon).
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<PathBuf>,
    pub timeout: Duration,
    /// Output kept per job (stdout and stderr together); the rest is counted, not stored.
    pub output_cap: u64,
    pub description: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTools {
    #[serde(default)]
    file: RawFile,
    #[serde(default)]
    service: RawService,
    #[serde(default)]
    docker: RawDocker,
    #[serde(default)]
    permissions: RawPermissions,
    max_running_jobs: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    read_roots: Vec<PathBuf>,
    #[serde(default)]
    write_roots: Vec<PathBuf>,
    max_read: Option<SizeText>,
    max_write: Option<SizeText>,
    #[serde(default)]
    new_files: BTreeMap<PathBuf, RawNewFiles>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNewFiles {
    /// Octal text, `"0640"`.
    mode: Option<String>,
    /// A group name or a numeric gid.
    group: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    #[serde(default)]
    units: Vec<String>,
    timeout: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDocker {
    socket: Option<PathBuf>,
    #[serde(default)]
    containers: Vec<String>,
    timeout: Option<DurationText>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPermissions {
    max_duration: Option<DurationText>,
    max_pending: Option<usize>,
    approval_expiry: Option<DurationText>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJob {
    argv: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    working_dir: Option<PathBuf>,
    timeout: Option<DurationText>,
    output_cap: Option<SizeText>,
    description: Option<String>,
}

/// A job template name: `[A-Za-z0-9_-]{1,64}`.
pub fn check_template_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 {
        return Err("must be 1 to 64 characters long".into());
    }
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_-".contains(*c)))
    {
        Some(c) => Err(format!("character {c:?} is outside [A-Za-z0-9_-]")),
        None => Ok(()),
    }
}

fn check_glob(pattern: &str) -> Result<(), String> {
    if pattern.is_empty()
        || !pattern
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-@:*?".contains(c))
    {
        return Err(format!("not a name pattern: {pattern:?}"));
    }
    Ok(())
}

fn positive(
    key: String,
    value: Option<DurationText>,
    default: Duration,
    issues: &mut Issues,
) -> Duration {
    let d = value.map_or(default, |d| d.0);
    if d.is_zero() {
        issues.add(key, "must be greater than zero");
    }
    d
}

fn size_within(
    key: &str,
    value: Option<SizeText>,
    default: u64,
    ceiling: u64,
    issues: &mut Issues,
) -> u64 {
    let v = value.map_or(default, |s| s.0);
    if v == 0 || v > ceiling {
        issues.add(
            key,
            format!("must be between 1 byte and {ceiling} bytes, got {v} bytes"),
        );
    }
    v
}

fn roots(key: &str, list: Vec<PathBuf>, issues: &mut Issues) -> Vec<PathBuf> {
    for (i, root) in list.iter().enumerate() {
        if !root.is_absolute() {
            issues.add(
                format!("{key}[{i}]"),
                format!("must be an absolute path, got {}", root.display()),
            );
        } else if root
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            issues.add(format!("{key}[{i}]"), "must not contain `..`");
        }
    }
    list
}

/// `[tools.file.new_files]`: each key a write root, each mode owner-read-writable and not
/// writable by others, each group one that exists.
fn new_files(
    write_roots: &[PathBuf],
    raw: BTreeMap<PathBuf, RawNewFiles>,
    issues: &mut Issues,
) -> BTreeMap<PathBuf, NewFiles> {
    let mut out = BTreeMap::new();
    for (root, settings) in raw {
        let key = format!("tools.file.new_files.\"{}\"", root.display());
        if !write_roots.contains(&root) {
            issues.add(
                key.clone(),
                format!("{} is not one of tools.file.write_roots", root.display()),
            );
        }
        let mut made = NewFiles::default();
        if let Some(text) = settings.mode {
            let digits = text.strip_prefix("0o").unwrap_or(&text);
            let octal = (1..=4).contains(&digits.len())
                && digits.bytes().all(|b| (b'0'..=b'7').contains(&b));
            match u32::from_str_radix(digits, 8).ok().filter(|_| octal).ok_or(()) {
                Ok(mode) if mode > 0o777 => issues.add(
                    format!("{key}.mode"),
                    format!("{text:?}: permission bits only (at most 0777; no setuid, setgid or sticky bit)"),
                ),
                Ok(mode) if mode & 0o600 != 0o600 => issues.add(
                    format!("{key}.mode"),
                    format!("{text:?}: the owner (the daemon's user) must keep read and write (0600)"),
                ),
                Ok(mode) if mode & 0o002 != 0 => issues.add(
                    format!("{key}.mode"),
                    format!("{text:?}: new files must not be writable by every user"),
                ),
                Ok(mode) => made.mode = mode,
                Err(_) => issues.add(
                    format!("{key}.mode"),
                    format!("{text:?} is not an octal mode such as \"0640\""),
                ),
            }
        }
        if let Some(group) = settings.group {
            let found = match group.parse::<u32>() {
                Ok(gid) => nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
                    .map(|g| g.map(|g| g.gid.as_raw()))
                    .map_err(|e| e.desc().to_owned()),
                Err(_) => nix::unistd::Group::from_name(&group)
                    .map(|g| g.map(|g| g.gid.as_raw()))
                    .map_err(|e| e.desc().to_owned()),
            };
            match found {
                Ok(Some(gid)) => made.gid = Some(gid),
                Ok(None) => issues.add(
                    format!("{key}.group"),
                    format!("there is no group {group:?}"),
                ),
                Err(e) => issues.add(
                    format!("{key}.group"),
                    format!("cannot look up group {group:?}: {e}"),
                ),
            }
        }
        out.insert(root, made);
    }
    out
}

pub(super) fn validate(
    raw: RawTools,
    jobs: BTreeMap<String, RawJob>,
    issues: &mut Issues,
) -> ToolsConfig {
    let new_files = new_files(&raw.file.write_roots, raw.file.new_files, issues);
    let file = FileTool {
        new_files,
        read_roots: roots("tools.file.read_roots", raw.file.read_roots, issues),
        write_roots: roots("tools.file.write_roots", raw.file.write_roots, issues),
        max_read: size_within(
            "tools.file.max_read",
            raw.file.max_read,
            FILE_BYTES_DEFAULT,
            FILE_BYTES_CEILING,
            issues,
        ),
        max_write: size_within(
            "tools.file.max_write",
            raw.file.max_write,
            FILE_BYTES_DEFAULT,
            FILE_BYTES_CEILING,
            issues,
        ),
    };
    for (i, unit) in raw.service.units.iter().enumerate() {
        if let Err(problem) = check_glob(unit) {
            issues.add(format!("tools.service.units[{i}]"), problem);
        }
    }
    let service = ServiceTool {
        units: raw.service.units,
        timeout: positive(
            "tools.service.timeout".into(),
            raw.service.timeout,
            ServiceTool::default().timeout,
            issues,
        ),
    };
    for (i, name) in raw.docker.containers.iter().enumerate() {
        if let Err(problem) = check_glob(name) {
            issues.add(format!("tools.docker.containers[{i}]"), problem);
        }
    }
    let socket = raw
        .docker
        .socket
        .unwrap_or_else(|| DockerTool::default().socket);
    if !socket.is_absolute() {
        issues.add(
            "tools.docker.socket",
            format!("must be an absolute path, got {}", socket.display()),
        );
    }
    let docker = DockerTool {
        socket,
        containers: raw.docker.containers,
        timeout: positive(
            "tools.docker.timeout".into(),
            raw.docker.timeout,
            DockerTool::default().timeout,
            issues,
        ),
    };
    let max_pending = raw.permissions.max_pending.unwrap_or(8);
    if max_pending == 0 || max_pending > 1024 {
        issues.add(
            "tools.permissions.max_pending",
            format!("must be between 1 and 1024, got {max_pending}"),
        );
    }
    let max_duration = positive(
        "tools.permissions.max_duration".into(),
        raw.permissions.max_duration,
        PermissionsTool::default().max_duration,
        issues,
    );
    let approval_expiry = raw
        .permissions
        .approval_expiry
        .map_or(PermissionsTool::default().approval_expiry, |d| d.0);
    if approval_expiry.as_secs() == 0
        || approval_expiry.subsec_nanos() != 0
        || approval_expiry > max_duration
    {
        issues.add(
            "tools.permissions.approval_expiry",
            format!(
                "must be whole seconds between 1s and max_duration ({})",
                humantime::format_duration(max_duration)
            ),
        );
    }
    let permissions = PermissionsTool {
        max_duration,
        max_pending,
        approval_expiry,
    };
    let max_running_jobs = raw.max_running_jobs.unwrap_or(16);
    if max_running_jobs == 0 || max_running_jobs > 1024 {
        issues.add(
            "tools.max_running_jobs",
            format!("must be between 1 and 1024, got {max_running_jobs}"),
        );
    }

    let mut templates = BTreeMap::new();
    for (name, job) in jobs {
        if let Err(problem) = check_template_name(&name) {
            issues.add(
                format!("jobs.{name}"),
                format!("bad template name: {problem}"),
            );
        }
        match job.argv.first() {
            None => issues.add(format!("jobs.{name}.argv"), "must name an executable"),
            Some(exe) if !Path::new(exe).is_absolute() => issues.add(
                format!("jobs.{name}.argv"),
                format!("the executable must be an absolute path, got {exe:?}"),
            ),
            Some(_) => {}
        }
        if let Some(dir) = &job.working_dir
            && !dir.is_absolute()
        {
            issues.add(
                format!("jobs.{name}.working_dir"),
                format!("must be an absolute path, got {}", dir.display()),
            );
        }
        for key in job.env.keys() {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                issues.add(
                    format!("jobs.{name}.env"),
                    format!("bad variable name {key:?}"),
                );
            }
        }
        let timeout = positive(
            format!("jobs.{name}.timeout"),
            job.timeout,
            Duration::from_secs(30 * 60),
            issues,
        );
        let output_cap = size_within(
            &format!("jobs.{name}.output_cap"),
            job.output_cap,
            JOB_OUTPUT_DEFAULT,
            JOB_OUTPUT_CEILING,
            issues,
        );
        templates.insert(
            name.clone(),
            JobTemplate {
                name,
                argv: job.argv,
                env: job.env,
                working_dir: job.working_dir,
                timeout,
                output_cap,
                description: job.description,
            },
        );
    }

    ToolsConfig {
        file,
        service,
        docker,
        permissions,
        jobs: templates,
        max_running_jobs,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{ConfigIssue, Environment, parse};

    fn env() -> Environment {
        Environment {
            runtime_directory: Some("/run/robota-mcpd".into()),
            state_directory: Some("/var/lib/robota-mcpd".into()),
            ..Environment::default()
        }
    }

    fn paths(text: &str) -> Vec<String> {
        parse(text, &env())
            .expect_err("config should be refused")
            .into_iter()
            .map(|ConfigIssue { path, .. }| path)
            .collect()
    }

    #[test]
    fn the_spec_example_parses() {
        let config = parse(
            r#"
[tools.file]
read_roots = ["/var/log", "/etc/myapp"]
write_roots = ["/etc/myapp"]

[tools.service]
units = ["nginx.service", "myapp-*.service"]

[tools.docker]
socket = "/run/docker.sock"
containers = ["web", "worker-*"]

[jobs.backup]
argv = ["/usr/local/bin/backup", "--all"]
timeout = "30m"
"#,
            &env(),
        )
        .unwrap();
        let t = config.tools;
        assert_eq!(t.file.read_roots.len(), 2);
        assert_eq!(t.service.units[1], "myapp-*.service");
        assert_eq!(t.docker.containers, ["web", "worker-*"]);
        let backup = &t.jobs["backup"];
        assert_eq!(backup.timeout, std::time::Duration::from_secs(1800));
        assert_eq!(backup.output_cap, super::JOB_OUTPUT_DEFAULT);
        assert!(backup.env.is_empty());
    }

    #[test]
    fn every_problem_names_its_key() {
        let found = paths(
            r#"
[tools.file]
read_roots = ["relative/dir"]
write_roots = ["/etc/../root"]
max_read = "0"

[tools.service]
units = ["nginx service"]
timeout = "0s"

[tools.docker]
socket = "docker.sock"
containers = ["a/b"]

[tools.permissions]
max_pending = 0

[jobs."bad name"]
argv = ["/bin/true"]

[jobs.relative]
argv = ["backup"]
working_dir = "tmp"
env = { "A=B" = "x" }

[jobs.empty]
argv = []
output_cap = "1GiB"
"#,
        );
        for key in [
            "tools.file.read_roots[0]",
            "tools.file.write_roots[0]",
            "tools.file.max_read",
            "tools.service.units[0]",
            "tools.service.timeout",
            "tools.docker.socket",
            "tools.docker.containers[0]",
            "tools.permissions.max_pending",
            "jobs.bad name",
            "jobs.relative.argv",
            "jobs.relative.working_dir",
            "jobs.relative.env",
            "jobs.empty.argv",
            "jobs.empty.output_cap",
        ] {
            assert!(
                found.iter().any(|p| p == key),
                "{key} not reported: {found:?}"
            );
        }
    }

    #[test]
    fn unknown_keys_in_the_new_sections_are_refused_with_their_path() {
        let err = parse("[tools.file]\nroots = []\n", &env()).unwrap_err();
        assert!(err[0].to_string().contains("tools.file"), "{err:?}");
        let err = parse(
            "[jobs.x]\nargv = [\"/bin/true\"]\ncommand = \"rm\"\n",
            &env(),
        )
        .unwrap_err();
        assert!(err[0].to_string().contains("jobs.x"), "{err:?}");
    }
}
