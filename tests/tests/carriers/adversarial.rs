//! Slow and stuck clients: a client that trickles its request head is cut at the head
//! deadline and cannot hold the connection limit against others; an admitted client that
//! never finishes its body is answered 408 at the body deadline and gives its in-flight
//! slot back.

use std::time::Duration;

use robota_e2e::http::{Conn, Request, exchange, tools_list};
use robota_e2e::{Daemon, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickling_heads_do_not_exhaust_the_connection_limit() {
    let d = Daemon::builder()
        .loopback("max_connections = 4")
        .loopback("header_timeout = \"1s\"")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    // Four clients take every connection slot and send one byte of head every 250 ms.
    let head = format!("POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n", addr.port()).into_bytes();
    let mut tricklers = Vec::new();
    for _ in 0..4 {
        let head = head.clone();
        tricklers.push(tokio::spawn(async move {
            let mut conn = Conn::connect(addr).await.expect("connect");
            for byte in head.iter().cycle().take(40) {
                if conn.write(std::slice::from_ref(byte)).await.is_err() {
                    return true; // cut by the daemon
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            false
        }));
    }
    // Wait until the four hold every slot.
    let held = robota_e2e::poll_until(Duration::from_secs(5), Duration::from_millis(10), || {
        robota_e2e::metric_sum(
            &d.metrics_text().unwrap_or_default(),
            &["robota_mcpd_connections_open", "listener=\"loopback\""],
        ) >= 4.0
    })
    .await;
    assert!(held, "the trickling clients never held the slots");
    // A well-behaved client still gets served, once the tricklers are cut (~1 s).
    let served = within(
        Duration::from_secs(8),
        "a valid request behind four trickling clients",
        exchange(
            addr,
            &Request::mcp(addr.port(), Some(&bearer), &tools_list(1)),
        ),
    )
    .await;
    assert_eq!(served.status, 200, "{}", served.describe());
    for t in tricklers {
        let cut = within(Duration::from_secs(15), "trickler", t)
            .await
            .expect("trickler task");
        assert!(
            cut,
            "a client that trickled its head for 10 s was never cut off"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_body_is_cut_at_the_body_deadline_and_frees_its_slot() {
    let d = Daemon::builder()
        .loopback("max_in_flight = 1")
        .loopback("body_timeout = \"1s\"")
        .start();
    let addr = d.loopback_addr();
    let bearer = d.bearer();
    let stuck = Request::mcp(addr.port(), Some(&bearer), &tools_list(1))
        .set_header("Content-Length", "1000")
        .no_auto_length();
    let mut conn = Conn::connect(addr).await.expect("connect");
    let mut bytes = stuck.head_bytes();
    bytes.extend_from_slice(b"{\"jsonrpc\":");
    conn.write(&bytes)
        .await
        .expect("write head and part of the body");
    let resp = within(
        Duration::from_secs(8),
        "answer to a body that never ends",
        conn.read_head(),
    )
    .await
    .expect("response head");
    assert_eq!(resp.status, 408, "{}", resp.describe());
    assert_eq!(resp.content_length(), Some(0));
    // The only in-flight slot is free again.
    let ok = exchange(
        addr,
        &Request::mcp(addr.port(), Some(&bearer), &tools_list(2)),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.describe());
    d.assert_no_secrets();
}
