//! First-party host tools. Each is a [`TypedTool`](crate::catalog::TypedTool): a
//! spec whose input schema is generated from its argument struct, and an async call that
//! gets that struct. Tools that need daemon services (jobs, grants, the store) hold them
//! from construction; the file tools hold their roots' descriptors.

mod docker;
mod file;
mod job;
mod permissions;
mod service;
mod system;

pub use system::info as host_info;

use std::sync::Arc;

use crate::catalog::HostTool;
use crate::catalog::ToolError;
use crate::config::{Config, ConfigIssue};
use crate::host::Host;
use crate::vocab::ToolErrorCode;

/// Why the first-party tools could not be built: the configuration names something the
/// host does not offer safely (a file root that is missing, a link, or below a directory
/// another user could swap). Each issue names its key.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct BuildError(pub Vec<ConfigIssue>);

/// Every first-party tool, in no particular order (the catalog sorts and validates).
pub fn first_party(
    config: &Config,
    host: &Arc<Host>,
) -> Result<Vec<Arc<dyn HostTool>>, BuildError> {
    let mut tools: Vec<Arc<dyn HostTool>> = vec![Arc::new(system::Info), Arc::new(system::Health)];
    tools.extend(file::tools(&config.tools.file).map_err(BuildError)?);
    tools.extend(service::tools(&config.tools.service, host));
    tools.extend(docker::tools(&config.tools.docker, host));
    tools.extend(job::tools(&config.tools.jobs, host));
    tools.extend(permissions::tools(host));
    Ok(tools)
}

/// A visible `invalid_arguments` error.
pub(crate) fn invalid(message: impl Into<String>) -> ToolError {
    ToolError::new(ToolErrorCode::InvalidArguments, message)
}

/// A visible `internal` error; the detail goes to the log, not to the caller.
pub(crate) fn internal(what: &str, e: impl std::fmt::Display) -> ToolError {
    tracing::warn!(error = %e, "{what} failed");
    ToolError::new(ToolErrorCode::Internal, format!("{what} failed"))
}

/// Whether `name` matches one of the configured globs (units, containers).
pub(crate) fn allowed(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| glob_match::glob_match(p, name))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::{Value, json};
    use tokio_util::sync::CancellationToken;

    use crate::catalog::{Args, ToolError, ToolOutput};
    use crate::session::RuntimeTools;
    use crate::session::tests::session;
    use crate::vocab::{Caller, ToolErrorCode};

    fn object(v: Value) -> Args {
        v.as_object().cloned().unwrap()
    }

    fn types(schema: &Value) -> Vec<&str> {
        match &schema["type"] {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        }
    }

    #[test]
    fn every_first_party_schema_is_a_closed_object() {
        let s = session("");
        assert_eq!(s.catalog().len(), 16);
        for spec in s.catalog().specs() {
            let schema = &spec.input_schema;
            assert_eq!(schema["type"], "object", "{}", spec.name);
            assert_eq!(schema["additionalProperties"], false, "{}", spec.name);
            assert!(schema["properties"].is_object(), "{}", spec.name);
            for noise in ["$schema", "title", "description", "$defs"] {
                assert!(!schema.contains_key(noise), "{}: {noise}", spec.name);
            }
            for (name, property) in schema["properties"].as_object().unwrap() {
                assert!(
                    property["description"]
                        .as_str()
                        .is_some_and(|d| !d.is_empty()),
                    "{}.{name} has no description",
                    spec.name
                );
            }
        }
    }

    /// Every integer argument of every first-party tool, as the schemas list them: a value
    /// JSON Schema calls an integer but the argument's type cannot hold (`1.0`, `2^64`,
    /// `1e300`), a negative one, and one just past the declared range are each
    /// `invalid_arguments` naming the argument, never a default in its place. The smallest
    /// good value, in the same call, is not: the refusals are the value's alone.
    #[tokio::test]
    async fn every_integer_argument_refuses_what_it_cannot_hold() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f.txt");
        std::fs::write(&file, "hello").unwrap();
        let s = session(&format!(
            "[tools.file]\nread_roots = [\"{root}\"]\n\
             [tools.docker]\nsocket = \"{root}/no-engine.sock\"\ncontainers = [\"web\"]\n\
             [jobs.quick]\nargv = [\"/bin/true\"]\n\
             [[policy]]\ncallers = [\"*\"]\ntools = [\"*\"]\ndecision = \"allow\"\n",
            root = dir.path().display()
        ));
        let caller = Caller::Local(0);
        let call = async |tool: &str, args: Value| -> Result<ToolOutput, ToolError> {
            s.invoke_runtime_tool(
                &caller.clone().into(),
                tool,
                object(args),
                CancellationToken::new(),
                Default::default(),
            )
            .await
        };
        // Something for the good values to find: a job and a grant of this caller.
        let Ok(ToolOutput::Job(job)) = call("job.start", json!({"template": "quick"})).await else {
            panic!("job.start failed")
        };
        let Ok(ToolOutput::Structured(grant)) =
            call("permissions.request_root_access", json!({"reason": "test"})).await
        else {
            panic!("the grant request failed")
        };
        let context = |tool: &str| match tool {
            "file.read" => json!({"path": file.display().to_string()}),
            "job.status" | "job.tail" | "job.cancel" => json!({"job_id": job.job_id}),
            "docker.logs" => json!({"container": "web"}),
            "permissions.revoke_root_access" => json!({"grant_id": grant["grant_id"]}),
            _ => json!({}),
        };
        let two_to_the_64: Value = serde_json::from_str("18446744073709551616").unwrap();

        let specs: Vec<_> = s.catalog().specs().cloned().collect();
        let mut seen = BTreeSet::new();
        for spec in &specs {
            let tool = spec.name.as_str();
            for (name, schema) in spec.input_schema["properties"].as_object().unwrap() {
                if !types(schema).contains(&"integer") {
                    continue;
                }
                seen.insert(format!("{tool}.{name}"));
                let mut bad = vec![json!(1.0), json!(-1), two_to_the_64.clone(), json!(1e300)];
                if let Some(max) = schema["maximum"].as_u64() {
                    bad.push(json!(max + 1));
                }
                if let Some(min) = schema["minimum"].as_u64().filter(|m| *m > 0) {
                    bad.push(json!(min - 1));
                }
                for value in bad {
                    let mut args = context(tool);
                    args[name] = value.clone();
                    let err = call(tool, args.clone())
                        .await
                        .expect_err(&format!("{tool} {args} should be refused"));
                    assert_eq!(
                        err.code,
                        ToolErrorCode::InvalidArguments,
                        "{tool} {args}: {err}"
                    );
                    assert!(err.message.contains(name.as_str()), "{tool} {args}: {err}");
                }
                let mut args = context(tool);
                if args.get(name).is_none() {
                    args[name] = json!(schema["minimum"].as_u64().unwrap_or(0));
                }
                if let Err(err) = call(tool, args.clone()).await {
                    assert_ne!(
                        err.code,
                        ToolErrorCode::InvalidArguments,
                        "{tool} {args}: {err}"
                    );
                }
            }
        }
        let expected: BTreeSet<String> = [
            "docker.logs.since",
            "docker.logs.tail",
            "file.read.length",
            "file.read.offset",
            "job.cancel.job_id",
            "job.status.job_id",
            "job.tail.cursor",
            "job.tail.job_id",
            "job.tail.max_bytes",
            "permissions.revoke_root_access.grant_id",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        assert_eq!(seen, expected);
    }
}
