//! Idempotency for replay-safe tools: the same key from the same caller returns the first
//! result without a second effect; the same key with other arguments is refused; a call
//! still running is `busy`; a call that was cut off has an unknown outcome. Outcomes that
//! prove no effect release the key.

use std::sync::Arc;

use serde_json::Value;

use crate::catalog::{Args, IDEMPOTENCY_KEY, ToolError, ToolOutput};
use crate::metrics::Metrics;
use crate::store::{IdemRecord, Store};
use crate::vocab::{Caller, Duplicate, ToolErrorCode};

/// Error codes that guarantee a call had no effect: its idempotency key is released, so a
/// retry with the same key runs again. Every other outcome is kept as the key's result.
const NO_EFFECT: [ToolErrorCode; 5] = [
    ToolErrorCode::InvalidArguments,
    ToolErrorCode::PermissionDenied,
    ToolErrorCode::InteractivePermissionRequired,
    ToolErrorCode::Busy,
    ToolErrorCode::Unavailable,
];

fn encode_outcome(result: &Result<ToolOutput, ToolError>) -> String {
    let value = match result {
        Ok(ToolOutput::Structured(v)) => serde_json::json!({"structured": v}),
        Ok(ToolOutput::Text(t)) => serde_json::json!({"text": t}),
        Ok(ToolOutput::Job(job)) => serde_json::json!({"job": job}),
        Ok(ToolOutput::Passthrough(result)) => serde_json::json!({"passthrough": result}),
        Err(e) => serde_json::json!({"error": {"code": e.code.as_str(), "message": e.message}}),
    };
    value.to_string()
}

fn decode_outcome(text: &str) -> Result<ToolOutput, ToolError> {
    let corrupt = || ToolError::new(ToolErrorCode::Internal, "a stored result could not be read");
    let value: Value = serde_json::from_str(text).map_err(|_| corrupt())?;
    if let Some(v) = value.get("structured") {
        return Ok(ToolOutput::Structured(v.clone()));
    }
    if let Some(t) = value.get("text").and_then(Value::as_str) {
        return Ok(ToolOutput::Text(t.to_owned()));
    }
    if let Some(Value::Object(result)) = value.get("passthrough") {
        return Ok(ToolOutput::Passthrough(result.clone()));
    }
    if let Some(job) = value.get("job") {
        return serde_json::from_value(job.clone())
            .map(ToolOutput::Job)
            .map_err(|_| corrupt());
    }
    let code = value["error"]["code"].as_str().unwrap_or_default();
    let code = ToolErrorCode::parse(code).ok_or_else(corrupt)?;
    Err(ToolError::new(
        code,
        value["error"]["message"].as_str().unwrap_or_default(),
    ))
}

/// SHA-256 of the canonical text of the arguments without the key.
fn args_digest(args: &Args) -> String {
    crate::canonical::canonical_sha256(&Value::Object(args.clone()))
}

/// Idempotency for replay-safe tools: keys recorded in the store, by caller and tool.
pub struct Idempotency {
    store: Arc<Store>,
    metrics: Metrics,
}

impl Idempotency {
    pub fn new(store: Arc<Store>, metrics: Metrics) -> Self {
        Self { store, metrics }
    }

    /// Run a replay-safe tool under its idempotency key, if the caller gave one.
    pub async fn run<F, Fut>(
        &self,
        caller: &Caller,
        tool: &str,
        mut args: Args,
        call: F,
    ) -> Result<ToolOutput, ToolError>
    where
        F: FnOnce(Args) -> Fut,
        Fut: Future<Output = Result<ToolOutput, ToolError>>,
    {
        let Some(key) = args.remove(IDEMPOTENCY_KEY) else {
            return call(args).await;
        };
        let key = key.as_str().unwrap_or_default().to_owned();
        let digest = args_digest(&args);
        let caller_text = caller.to_string();
        let store = &*self.store;
        let internal = |e: crate::store::StoreError| ToolError::store(&e, "idempotency store");
        let mismatch = || {
            ToolError::new(
                ToolErrorCode::InvalidArguments,
                "this idempotency key was first used with different arguments; use a new key for a different call",
            )
        };
        match store
            .idem_reserve(&caller_text, tool, &key, &digest)
            .map_err(internal)?
        {
            IdemRecord::Reserved => {}
            IdemRecord::Done { args_sha256, .. }
            | IdemRecord::InProgress { args_sha256 }
            | IdemRecord::Unknown { args_sha256 }
                if args_sha256 != digest =>
            {
                self.metrics.duplicate(tool, Duplicate::Mismatch);
                return Err(mismatch());
            }
            IdemRecord::Done { result, .. } => {
                tracing::debug!(%caller, tool, "replayed a result by idempotency key");
                self.metrics.duplicate(tool, Duplicate::Replayed);
                return decode_outcome(&result);
            }
            IdemRecord::InProgress { .. } => {
                self.metrics.duplicate(tool, Duplicate::InProgress);
                return Err(ToolError::new(
                    ToolErrorCode::Busy,
                    "a call with this idempotency key is still running; retry later for its result",
                ));
            }
            IdemRecord::Unknown { .. } => {
                self.metrics.duplicate(tool, Duplicate::OutcomeUnknown);
                return Err(ToolError::new(
                    ToolErrorCode::OutcomeUnknown,
                    "outcome unknown: the first call with this idempotency key was cut off by a daemon restart; check the target and retry with a new key",
                ));
            }
        }
        let mut interrupted = Interrupted {
            store,
            key: Some((caller_text.clone(), tool.to_owned(), key.clone())),
        };
        let result = call(args).await;
        interrupted.key = None;
        let kept = match &result {
            Err(e) if NO_EFFECT.contains(&e.code) => store.idem_release(&caller_text, tool, &key),
            outcome => store.idem_finish(&caller_text, tool, &key, &encode_outcome(outcome)),
        };
        if let Err(e) = kept {
            tracing::error!(error = %e, "cannot record an idempotent call's outcome");
        }
        result
    }
}

/// Marks a reserved idempotency key's outcome unknown if the call's future is dropped
/// before it finished (the client went away mid-call; the effect may still land).
struct Interrupted<'a> {
    store: &'a Store,
    key: Option<(String, String, String)>,
}

impl Drop for Interrupted<'_> {
    fn drop(&mut self) {
        if let Some((caller, tool, key)) = self.key.take()
            && let Err(e) = self.store.idem_mark_unknown(&caller, &tool, &key)
        {
            tracing::error!(error = %e, "cannot mark an interrupted call's key");
        }
    }
}
