//! `job.start`, `job.status`, `job.tail`, `job.cancel`: durable jobs from `[jobs.<name>]`
//! templates. A caller sees and cancels only its own jobs.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::json;

use super::{arg_str, arg_u64, invalid, schema};
use crate::config::JobTemplate;
use crate::host::Host;
use crate::jobs::{JobKind, Jobs, TAIL_PAGE_MAX, Work};
use crate::session::catalog::{
    Annotations, HostTool, IDEMPOTENCY_KEY, ToolFuture, ToolSpec, idempotency_key_schema,
};
use crate::session::{Args, ToolContext, ToolError, ToolOutput};

pub fn tools(
    templates: &BTreeMap<String, JobTemplate>,
    host: &Arc<Host>,
) -> Vec<Box<dyn HostTool>> {
    let jobs = &host.jobs;
    vec![
        Box::new(Start {
            templates: templates.clone(),
            jobs: Arc::clone(jobs),
        }),
        Box::new(Status(Arc::clone(jobs))),
        Box::new(Tail(Arc::clone(jobs))),
        Box::new(Cancel(Arc::clone(jobs))),
    ]
}

fn structured<T: serde::Serialize>(value: &T) -> Result<ToolOutput, ToolError> {
    serde_json::to_value(value)
        .map(ToolOutput::Structured)
        .map_err(|e| super::internal("encoding the job", e))
}

fn job_id(args: &Args) -> Result<i64, ToolError> {
    args.get("job_id")
        .and_then(serde_json::Value::as_i64)
        .ok_or_else(|| invalid("job_id must be an integer"))
}

fn job_id_schema() -> serde_json::Value {
    json!({"type": "integer", "minimum": 1, "description": "The job handle job.start returned."})
}

struct Start {
    templates: BTreeMap<String, JobTemplate>,
    jobs: Arc<Jobs>,
}

impl HostTool for Start {
    fn spec(&self) -> ToolSpec {
        let names: Vec<&String> = self.templates.keys().collect();
        let mut template = json!({
            "type": "string",
            "description": "The name of a job template configured on this host ([jobs.<name>])."
        });
        if !names.is_empty() {
            template["enum"] = json!(names);
        }
        ToolSpec {
            name: "job.start".into(),
            description: "Start a job from a template configured on this host; returns a durable job handle at once. Follow it with job.status and job.tail.".into(),
            input_schema: schema(json!({
                "type": "object",
                "properties": {"template": template, IDEMPOTENCY_KEY: idempotency_key_schema()},
                "required": ["template"],
                "additionalProperties": false
            })),
            annotations: Annotations {
                read_only: false,
                destructive: false,
                idempotent: false,
                self_service: false,
                replay_safe: true,
            },
        }
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        Box::pin(async move {
            let name = arg_str(&args, "template").unwrap_or_default();
            let Some(template) = self.templates.get(name) else {
                return Err(invalid(format!(
                    "there is no job template {name:?} on this host"
                )));
            };
            let job = self.jobs.start(
                ctx.caller,
                JobKind::Template,
                name,
                None,
                Work::Process(template.clone()),
            )?;
            Ok(ToolOutput::Job(job))
        })
    }
}

struct Status(Arc<Jobs>);

impl HostTool for Status {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "job.status".into(),
            description: "The state of one of your jobs: running, succeeded, failed, cancelled, timed-out or outcome-unknown (the daemon stopped while it ran; it was not re-run).".into(),
            input_schema: schema(json!({
                "type": "object",
                "properties": {"job_id": job_id_schema()},
                "required": ["job_id"],
                "additionalProperties": false
            })),
            annotations: Annotations::READ_ONLY,
        }
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        Box::pin(async move { structured(&self.0.visible(Some(ctx.caller), job_id(&args)?)?) })
    }
}

struct Tail(Arc<Jobs>);

impl HostTool for Tail {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "job.tail".into(),
            description: "A page of one of your jobs' output from a cursor (a byte offset; start at 0). Pass next_cursor back for the next page; complete is true once the job has ended and everything was read.".into(),
            input_schema: schema(json!({
                "type": "object",
                "properties": {
                    "job_id": job_id_schema(),
                    "cursor": {"type": "integer", "minimum": 0},
                    "max_bytes": {"type": "integer", "minimum": 1, "maximum": TAIL_PAGE_MAX}
                },
                "required": ["job_id"],
                "additionalProperties": false
            })),
            annotations: Annotations::READ_ONLY,
        }
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        Box::pin(async move {
            let page = self.0.tail(
                Some(ctx.caller),
                job_id(&args)?,
                arg_u64(&args, "cursor").unwrap_or(0),
                arg_u64(&args, "max_bytes").unwrap_or(64 * 1024),
            )?;
            structured(&page)
        })
    }
}

struct Cancel(Arc<Jobs>);

impl HostTool for Cancel {
    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: "job.cancel".into(),
            description: "Cancel one of your running jobs (its whole process group is killed). Cancelling a finished job changes nothing and returns its state.".into(),
            input_schema: schema(json!({
                "type": "object",
                "properties": {"job_id": job_id_schema()},
                "required": ["job_id"],
                "additionalProperties": false
            })),
            annotations: Annotations {
                read_only: false,
                destructive: true,
                idempotent: true,
                self_service: true,
                replay_safe: false,
            },
        }
    }

    fn call<'a>(&'a self, ctx: &'a ToolContext<'a>, args: Args) -> ToolFuture<'a> {
        Box::pin(async move { structured(&self.0.cancel(Some(ctx.caller), job_id(&args)?)?) })
    }
}
