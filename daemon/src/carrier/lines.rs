//! Newline-delimited JSON-RPC over a byte stream (stdin/stdout, a relayed control
//! connection), as the MCP SDK's transport, with the carrier's own bounds.
//!
//! Each line is one message, at most the request limit long; a longer line is answered
//! with a JSON-RPC error and skipped to its end (never buffered). Every line passes the
//! same strict look as an HTTP body ([`crate::jsonrpc`]): a parse error, a batch, a bad
//! id or params are answered here with the id where it is known, and never reach the SDK.

use std::borrow::Cow;

use std::collections::HashMap;
use std::sync::Arc;

use bytes::BytesMut;
use parking_lot::Mutex;
use rmcp::RoleServer;
use rmcp::model::RequestId;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::codec::{AnyDelimiterCodec, AnyDelimiterCodecError, Decoder};
use tokio_util::sync::CancellationToken;

use crate::jsonrpc;
use crate::mcp::AnswerSlot;
use crate::vocab::Caller;

/// Lines waiting to be written.
const QUEUE: usize = 64;

/// An rmcp server transport over `read`/`write`, with lines capped at `limit` bytes; every
/// message carries `caller` (see [`crate::mcp::admitted`]). Two tasks do the I/O; they end
/// when the peer closes or the transport is dropped.
pub fn transport<R, W>(read: R, write: W, limit: usize, caller: Caller) -> LinesTransport
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (out, mut outbound) = mpsc::channel::<Vec<u8>>(QUEUE);
    let slots = AnswerSlots::default();
    let (to_server, inbound) = mpsc::channel::<RxJsonRpcMessage<RoleServer>>(QUEUE);
    // Fired when the SDK drops the transport: the reader stops, the writer sends what is
    // queued and closes its side, so the peer sees the end.
    let closed = CancellationToken::new();
    tokio::spawn({
        let closed = closed.clone();
        async move {
            let mut write = write;
            loop {
                let line = tokio::select! {
                    line = outbound.recv() => line,
                    () = closed.cancelled() => outbound.try_recv().ok(),
                };
                let Some(mut line) = line else { break };
                line.push(b'\n');
                if write.write_all(&line).await.is_err() || write.flush().await.is_err() {
                    break;
                }
            }
            let _ = write.shutdown().await;
        }
    });
    let answers = out.clone();
    let stop = closed.clone();
    let reader_slots = slots.clone();
    tokio::spawn(async move {
        let mut read = read;
        // A line over the limit is answered, then dropped to its end by the codec
        // (which never buffers more than the limit).
        let mut codec = AnyDelimiterCodec::new_with_max_length(b"\n".to_vec(), Vec::new(), limit);
        let mut buf = BytesMut::with_capacity(8 * 1024);
        loop {
            let refusal = match codec.decode(&mut buf) {
                Ok(None) => {
                    let more = tokio::select! {
                        more = read.read_buf(&mut buf) => more,
                        () = stop.cancelled() => break,
                    };
                    match more {
                        Ok(0) | Err(_) => break,
                        Ok(_) => continue,
                    }
                }
                // Blank lines between messages are tolerated, not answered.
                Ok(Some(line)) if line.iter().all(u8::is_ascii_whitespace) => continue,
                Ok(Some(line)) => match accept(&line) {
                    Ok(mut message) => {
                        admit(&mut message, &caller, &reader_slots);
                        if to_server.send(message).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    Err(refusal) => refusal,
                },
                Err(AnyDelimiterCodecError::MaxChunkLengthExceeded) => serde_json::json!({
                    "jsonrpc": "2.0",
                    "id": null,
                    "error": {
                        "code": -32600,
                        "message": format!("Invalid Request: a message is at most {limit} bytes"),
                    },
                }),
                Err(AnyDelimiterCodecError::Io(_)) => break,
            };
            if answers
                .send(refusal.to_string().into_bytes())
                .await
                .is_err()
            {
                break;
            }
        }
    });
    LinesTransport {
        out,
        inbound,
        slots,
        _closed: closed.drop_guard(),
    }
}

/// The answer slots of the `tools/call` and `tools/list` requests being answered, by
/// request id.
#[derive(Clone, Default)]
struct AnswerSlots(Arc<Mutex<Slots>>);

/// Slots of cancelled calls kept, newest last: the SDK usually sends no answer to a
/// cancelled request, but one that finished as the cancellation came may still go out.
const CANCELLED_KEPT: usize = 64;

#[derive(Default)]
struct Slots {
    live: HashMap<RequestId, AnswerSlot>,
    cancelled: std::collections::VecDeque<(RequestId, AnswerSlot)>,
}

impl Slots {
    fn insert(&mut self, id: RequestId, slot: AnswerSlot) {
        self.live.insert(id, slot);
    }

    /// A cancelled call's slot leaves the table (which would otherwise grow with every
    /// cancelled call of a long-lived connection) for the short list of recent ones.
    fn cancel(&mut self, id: &RequestId) {
        if let Some(slot) = self.live.remove(id) {
            if self.cancelled.len() == CANCELLED_KEPT {
                self.cancelled.pop_front();
            }
            self.cancelled.push_back((id.clone(), slot));
        }
    }

    fn remove(&mut self, id: &RequestId) -> Option<AnswerSlot> {
        self.live.remove(id).or_else(|| {
            let at = self.cancelled.iter().position(|(c, _)| c == id)?;
            self.cancelled.remove(at).map(|(_, slot)| slot)
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.live.len() + self.cancelled.len()
    }
}

/// Hands the admitted caller to the handler, the way the HTTP carriers do; a `tools/call`
/// or `tools/list` also gets an answer slot.
fn admit(message: &mut RxJsonRpcMessage<RoleServer>, caller: &Caller, slots: &AnswerSlots) {
    use rmcp::model::{ClientNotification, GetExtensions, JsonRpcMessage};
    // A line carrier's caller holds no token.
    let mut parts = crate::mcp::admitted(caller.clone().into());
    match message {
        JsonRpcMessage::Request(req) => {
            if AnswerSlot::wanted(&req.request) {
                let slot = AnswerSlot::default();
                parts.extensions.insert(slot.clone());
                slots.0.lock().insert(req.id.clone(), slot);
            }
            req.request.extensions_mut().insert(parts);
        }
        JsonRpcMessage::Notification(not) => {
            if let ClientNotification::CancelledNotification(cancelled) = &not.notification
                && let Some(id) = &cancelled.params.request_id
            {
                slots.0.lock().cancel(id);
            }
            not.notification.extensions_mut().insert(parts);
        }
        JsonRpcMessage::Response(_) | JsonRpcMessage::Error(_) => {}
    }
}

/// One line: the strict look, then the SDK's own parse; a refusal is the error answer.
fn accept(line: &[u8]) -> Result<RxJsonRpcMessage<RoleServer>, serde_json::Value> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let inspected = jsonrpc::inspect(line).map_err(|invalid| invalid.response())?;
    crate::mcp::read_message(inspected.method.as_deref(), inspected.id.is_some(), line).map_err(
        |_| {
            jsonrpc::Invalid::Request {
                id: inspected.id,
                why: "not a message this server understands",
            }
            .response()
        },
    )
}

/// The transport half the SDK drives.
pub struct LinesTransport {
    out: mpsc::Sender<Vec<u8>>,
    inbound: mpsc::Receiver<RxJsonRpcMessage<RoleServer>>,
    slots: AnswerSlots,
    _closed: tokio_util::sync::DropGuard,
}

impl Transport<RoleServer> for LinesTransport {
    type Error = std::io::Error;

    fn name() -> Cow<'static, str> {
        "lines".into()
    }

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        use rmcp::model::JsonRpcMessage;
        let out = self.out.clone();
        // An imported tool's result goes out whole, instead of rmcp's rendering of it.
        let answered = match &item {
            JsonRpcMessage::Response(r) => Some(&r.id),
            JsonRpcMessage::Error(e) => e.id.as_ref(),
            _ => None,
        };
        let slot = answered.and_then(|id| self.slots.0.lock().remove(id));
        let line = AnswerSlot::encode(slot.as_ref(), &item);
        async move {
            let line = line.map_err(std::io::Error::other)?;
            out.send(line)
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        self.inbound.recv().await
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        self.inbound.close();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};
    use tokio::io::{AsyncBufReadExt, BufReader};

    use super::*;

    #[tokio::test]
    async fn oversized_and_malformed_lines_are_answered_and_skipped() {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (read, write) = tokio::io::split(server);
        let mut transport = transport(read, write, 100, Caller::Local(0));
        let (client_read, mut client_write) = tokio::io::split(client);
        let long = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"params\":{{\"x\":\"{}\"}}}}\n",
            "a".repeat(500)
        );
        client_write.write_all(long.as_bytes()).await.unwrap();
        client_write
            .write_all(b"[{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"ping\"}]\n")
            .await
            .unwrap();
        client_write
            .write_all(
                b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"tools/call\",\"params\":null}\n",
            )
            .await
            .unwrap();
        client_write
            .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"ping\"}\n")
            .await
            .unwrap();
        let mut answers = BufReader::new(client_read).lines();
        let mut next = async || -> Value {
            serde_json::from_str(&answers.next_line().await.unwrap().unwrap()).unwrap()
        };
        let a = next().await;
        assert_eq!(
            (a["id"].clone(), a["error"]["code"].clone()),
            (Value::Null, json!(-32600))
        );
        let b = next().await;
        assert_eq!(b["error"]["code"], -32600, "a batch");
        let c = next().await;
        assert_eq!(
            (c["id"].clone(), c["error"]["code"].clone()),
            (json!(3), json!(-32602))
        );
        // The line after them all reaches the server intact.
        let ping = transport.receive().await.expect("the ping");
        assert!(serde_json::to_string(&ping).unwrap().contains("\"id\":4"));
    }

    #[test]
    fn cancelled_calls_keep_a_bounded_number_of_slots() {
        let slots = AnswerSlots::default();
        let caller = Caller::Local(0);
        let call = |id: usize| {
            let mut m = accept(
                format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"pg.query","arguments":{{}}}}}}"#)
                    .as_bytes(),
            )
            .expect("a tools/call");
            admit(&mut m, &caller, &slots);
        };
        let cancel = |id: usize| {
            let mut m = accept(
                format!(r#"{{"jsonrpc":"2.0","method":"notifications/cancelled","params":{{"requestId":{id}}}}}"#)
                    .as_bytes(),
            )
            .expect("a cancellation");
            admit(&mut m, &caller, &slots);
        };
        call(7);
        cancel(8);
        assert_eq!(
            slots.0.lock().live.len(),
            1,
            "another request's cancellation"
        );
        cancel(7);
        // A call that finished as it was cancelled still finds its slot.
        assert!(slots.0.lock().remove(&RequestId::Number(7)).is_some());
        for id in 100..100 + 3 * CANCELLED_KEPT {
            call(id);
            cancel(id);
        }
        assert_eq!(slots.0.lock().len(), CANCELLED_KEPT);
    }
}
