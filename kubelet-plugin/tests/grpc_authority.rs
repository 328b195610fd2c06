//! What a gRPC client other than the kubelet meets on the plugin's unix sockets.
//!
//! grpcurl, Python's grpcio and grpc-java send the socket path as the HTTP/2 `:authority`
//! when dialling a unix socket; the HTTP/2 layer under tonic (the `h2` crate) accepts only
//! a valid URI authority there and resets such a stream with `PROTOCOL_ERROR`. The kubelet
//! sends `localhost`. The operator docs (`docs/troubleshooting.md`) therefore tell people
//! to pass `-authority localhost`; this test speaks raw HTTP/2 frames to prove both halves
//! of that text: a path authority is reset with `PROTOCOL_ERROR`, `localhost` is answered.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use common::node::*;

const FRAME_DATA: u8 = 0x0;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_RST_STREAM: u8 = 0x3;
const FRAME_SETTINGS: u8 = 0x4;
const FRAME_GOAWAY: u8 = 0x7;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_ACK: u8 = 0x1;
/// HTTP/2 error code `PROTOCOL_ERROR` (RFC 9113 §7).
const PROTOCOL_ERROR: u32 = 0x1;

/// What the server answered on stream 1.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// A response HEADERS frame: the request was accepted (routed to the service).
    Answered,
    /// RST_STREAM with this error code.
    Reset(u32),
    /// GOAWAY with this error code.
    GoAway(u32),
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap();
    let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// An HPACK string length (7-bit prefix, no Huffman coding; RFC 7541 §5.1).
fn hpack_len(out: &mut Vec<u8>, len: usize) {
    if len < 127 {
        out.push(len as u8);
        return;
    }
    out.push(127);
    let mut rest = len - 127;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A header block of "literal header field without indexing, new name" entries.
fn header_block(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.push(0x00);
        hpack_len(&mut out, name.len());
        out.extend_from_slice(name.as_bytes());
        hpack_len(&mut out, value.len());
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// Sends one gRPC call (`GetInfo`, empty message) with this `:authority` over a fresh
/// connection and reports what the server did with stream 1.
fn call_with_authority(socket: &Path, authority: &str) -> Outcome {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(FRAME_SETTINGS, 0, 0, &[]));
    let block = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/pluginregistration.Registration/GetInfo"),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]);
    out.extend(frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &block));
    // An empty protobuf message: not compressed, length 0.
    out.extend(frame(FRAME_DATA, FLAG_END_STREAM, 1, &[0, 0, 0, 0, 0]));
    s.write_all(&out).unwrap();

    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head)
            .expect("the server closed without answering stream 1");
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).unwrap();
        match kind {
            FRAME_SETTINGS if flags & FLAG_ACK == 0 => {
                s.write_all(&frame(FRAME_SETTINGS, FLAG_ACK, 0, &[]))
                    .unwrap();
            }
            FRAME_HEADERS if stream == 1 => return Outcome::Answered,
            FRAME_RST_STREAM if stream == 1 => {
                return Outcome::Reset(u32::from_be_bytes(payload[..4].try_into().unwrap()));
            }
            FRAME_GOAWAY => {
                return Outcome::GoAway(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_authority_is_reset_with_protocol_error_and_localhost_is_answered() {
    let dirs = NodeDirs::new();
    let _standin = start_standin(&dirs).await;
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    for socket in [&plugin.registration_socket, &plugin.dra_socket] {
        let path = socket.display().to_string();
        assert_eq!(
            call_with_authority(socket, &path),
            Outcome::Reset(PROTOCOL_ERROR),
            "a path-shaped :authority on {path}"
        );
    }
    // The documented workaround: `-authority localhost` (what the kubelet sends).
    assert_eq!(
        call_with_authority(&plugin.registration_socket, "localhost"),
        Outcome::Answered
    );
    // The plugin survived the bad clients.
    assert_eq!(
        call_with_authority(&plugin.registration_socket, "localhost"),
        Outcome::Answered
    );
    assert!(plugin.terminate().success());
}
