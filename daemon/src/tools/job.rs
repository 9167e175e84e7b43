//! `job.start`, `job.status`, `job.tail`, `job.cancel`: durable jobs from `[jobs.<name>]`
//! templates. A caller sees and cancels only its own jobs.

use std::collections::BTreeMap;
use std::sync::Arc;

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use super::invalid;
use crate::catalog::{Annotations, HostTool, ToolFuture, ToolSpec, TypedTool};
use crate::catalog::{ToolContext, ToolError, ToolOutput};
use crate::config::JobTemplate;
use crate::host::Host;
use crate::jobs::{Jobs, TAIL_PAGE_MAX, Work};
use crate::vocab::{JobId, JobKind};

/// What `job.tail` returns at most when the caller names no `max_bytes`.
const TAIL_PAGE_DEFAULT: u64 = 64 * 1024;
/// The largest cursor: output offsets are stored as SQLite integers (`i64`).
const CURSOR_MAX: u64 = i64::MAX as u64;

pub fn tools(
    templates: &BTreeMap<String, JobTemplate>,
    host: &Arc<Host>,
) -> Vec<Arc<dyn HostTool>> {
    let jobs = &host.jobs;
    vec![
        Arc::new(Start {
            templates: templates.clone(),
            jobs: Arc::clone(jobs),
        }),
        Arc::new(Status(Arc::clone(jobs))),
        Arc::new(Tail(Arc::clone(jobs))),
        Arc::new(Cancel(Arc::clone(jobs))),
    ]
}

fn structured<T: serde::Serialize>(value: &T) -> Result<ToolOutput, ToolError> {
    serde_json::to_value(value)
        .map(ToolOutput::Structured)
        .map_err(|e| super::internal("encoding the job", e))
}

/// `job.start` arguments (the session has taken the idempotency key out).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct StartArgs {
    /// The name of a job template configured on this host ([jobs.<name>]).
    template: String,
}

/// `job.status` and `job.cancel` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct JobArgs {
    /// The job handle job.start returned.
    #[schemars(range(min = 1))]
    job_id: i64,
}

/// `job.tail` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct TailArgs {
    /// The job handle job.start returned.
    #[schemars(range(min = 1))]
    job_id: i64,
    /// Byte offset in the job's output to start at (0 for the beginning; next_cursor of the previous page).
    #[serde(default)]
    #[schemars(range(max = CURSOR_MAX))]
    cursor: u64,
    /// Bytes to return at most (default 65536).
    #[serde(default = "tail_page_default")]
    #[schemars(range(min = 1, max = TAIL_PAGE_MAX))]
    max_bytes: u64,
}

fn tail_page_default() -> u64 {
    TAIL_PAGE_DEFAULT
}

struct Start {
    templates: BTreeMap<String, JobTemplate>,
    jobs: Arc<Jobs>,
}

impl TypedTool for Start {
    type Args = StartArgs;

    fn spec(&self) -> ToolSpec {
        let mut spec = ToolSpec::typed::<Self::Args>(
            "job.start",
            "Start a job from a template configured on this host; returns a durable job handle at once. Follow it with job.status and job.tail.",
            Annotations {
                read_only: false,
                destructive: false,
                idempotent: false,
                self_service: false,
                replay_safe: true,
            },
        );
        let names: Vec<&String> = self.templates.keys().collect();
        if !names.is_empty()
            && let Some(template) = spec.property_mut("template")
        {
            template.insert("enum".into(), json!(names));
        }
        spec
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: StartArgs) -> ToolFuture<'a> {
        Box::pin(async move {
            let name = args.template.as_str();
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

impl TypedTool for Status {
    type Args = JobArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "job.status",
            "The state of one of your jobs: running, succeeded, failed, cancelled, timed-out or outcome-unknown (the process that ran it died, or an action was cut off before its end was known; it was not re-run).",
            Annotations::READ_ONLY,
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: JobArgs) -> ToolFuture<'a> {
        Box::pin(async move { structured(&self.0.visible(Some(ctx.caller), JobId(args.job_id))?) })
    }
}

struct Tail(Arc<Jobs>);

impl TypedTool for Tail {
    type Args = TailArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "job.tail",
            "A page of one of your jobs' output from a cursor (a byte offset; start at 0). Pass next_cursor back for the next page; complete is true once the job has ended and everything was read.",
            Annotations::READ_ONLY,
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: TailArgs) -> ToolFuture<'a> {
        Box::pin(async move {
            let page = self.0.tail(
                Some(ctx.caller),
                JobId(args.job_id),
                args.cursor,
                args.max_bytes,
            )?;
            structured(&page)
        })
    }
}

struct Cancel(Arc<Jobs>);

impl TypedTool for Cancel {
    type Args = JobArgs;

    fn spec(&self) -> ToolSpec {
        ToolSpec::typed::<Self::Args>(
            "job.cancel",
            "Cancel one of your running jobs (its whole process group is killed). Cancelling a finished job changes nothing and returns its state.",
            Annotations {
                read_only: false,
                destructive: true,
                idempotent: true,
                self_service: true,
                replay_safe: false,
            },
        )
    }

    fn run<'a>(&'a self, ctx: &'a ToolContext<'a>, args: JobArgs) -> ToolFuture<'a> {
        Box::pin(async move { structured(&self.0.cancel(Some(ctx.caller), JobId(args.job_id))?) })
    }
}
