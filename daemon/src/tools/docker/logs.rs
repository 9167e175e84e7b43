//! The body of `GET /containers/{name}/logs`: the multiplexed stream of a container
//! without a TTY (8-byte frame headers), or the raw stream of one with a TTY, assembled
//! into lines per stream and capped to the newest lines.
//!
//! Body chunks fall anywhere: inside a frame header, inside a payload, inside a UTF-8
//! sequence. Nothing here assumes a chunk, a frame or a line lines up with another.

use std::collections::VecDeque;

/// Length of a frame header: stream type, three zero bytes, big-endian payload length.
const HEADER_LEN: usize = 8;

/// The stream a line came from. The engine's stdin frames (type 0) are written on
/// stdout, as the Engine API documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }

    fn index(self) -> usize {
        match self {
            Stream::Stdout => 0,
            Stream::Stderr => 1,
        }
    }
}

/// Why a multiplexed stream could not be read to its end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("a frame header names stream type {0}, which is not stdin, stdout or stderr")]
    BadStream(u8),
    #[error("the stream ended inside a frame header ({got} of 8 bytes)")]
    TruncatedHeader { got: usize },
    #[error("the stream ended inside a frame ({missing} of its {len} payload bytes missing)")]
    TruncatedPayload { missing: u32, len: u32 },
}

/// Splits a multiplexed stream into payload pieces tagged with their stream.
#[derive(Debug)]
pub struct Demuxer {
    header: [u8; HEADER_LEN],
    /// Header bytes collected so far (while `remaining` is 0).
    have: usize,
    stream: Stream,
    len: u32,
    /// Payload bytes of the current frame still to come.
    remaining: u32,
    broken: Option<FrameError>,
}

impl Default for Demuxer {
    fn default() -> Self {
        Self {
            header: [0; HEADER_LEN],
            have: 0,
            stream: Stream::Stdout,
            len: 0,
            remaining: 0,
            broken: None,
        }
    }
}

impl Demuxer {
    /// Feeds one body chunk; `out` gets every payload piece in order. After an error the
    /// stream is not read further.
    pub fn feed(
        &mut self,
        mut data: &[u8],
        out: &mut impl FnMut(Stream, &[u8]),
    ) -> Result<(), FrameError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        while !data.is_empty() {
            if self.remaining == 0 {
                let take = (HEADER_LEN - self.have).min(data.len());
                self.header[self.have..self.have + take].copy_from_slice(&data[..take]);
                self.have += take;
                data = &data[take..];
                if self.have < HEADER_LEN {
                    break;
                }
                self.have = 0;
                self.stream = match self.header[0] {
                    0 | 1 => Stream::Stdout,
                    2 => Stream::Stderr,
                    other => {
                        let e = FrameError::BadStream(other);
                        self.broken = Some(e.clone());
                        return Err(e);
                    }
                };
                let [_, _, _, _, a, b, c, d] = self.header;
                self.len = u32::from_be_bytes([a, b, c, d]);
                self.remaining = self.len;
            } else {
                let take = data.len().min(self.remaining as usize);
                out(self.stream, &data[..take]);
                // `take` ≤ `remaining`, a u32.
                self.remaining -= take as u32;
                data = &data[take..];
            }
        }
        Ok(())
    }

    /// Whether the stream ended on a frame boundary.
    pub fn finish(&self) -> Result<(), FrameError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        if self.have > 0 {
            return Err(FrameError::TruncatedHeader { got: self.have });
        }
        if self.remaining > 0 {
            return Err(FrameError::TruncatedPayload {
                missing: self.remaining,
                len: self.len,
            });
        }
        Ok(())
    }
}

/// One line of log output, without its line ending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub stream: Stream,
    pub text: String,
}

/// Assembles lines per stream (a line may span frames and chunks) and keeps the newest
/// ones within `cap` bytes of text.
#[derive(Debug)]
pub struct Lines {
    /// The unfinished line of each stream, as bytes (a UTF-8 sequence may be split).
    pending: [Vec<u8>; 2],
    kept: VecDeque<Line>,
    text_bytes: usize,
    cap: usize,
    truncated: bool,
}

impl Lines {
    pub fn new(cap: usize) -> Self {
        Self {
            pending: [Vec::new(), Vec::new()],
            kept: VecDeque::new(),
            text_bytes: 0,
            cap: cap.max(1),
            truncated: false,
        }
    }

    pub fn push(&mut self, stream: Stream, mut bytes: &[u8]) {
        let i = stream.index();
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            self.pending[i].extend_from_slice(&bytes[..end]);
            let line = std::mem::take(&mut self.pending[i]);
            self.complete(stream, &line);
            bytes = &bytes[end + 1..];
        }
        let pending = &mut self.pending[i];
        pending.extend_from_slice(bytes);
        // An endless line keeps only its newest `cap` bytes (trimmed at twice the cap so
        // the copying stays linear).
        if pending.len() > 2 * self.cap {
            pending.drain(..pending.len() - self.cap);
            self.truncated = true;
        }
    }

    fn complete(&mut self, stream: Stream, bytes: &[u8]) {
        let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        let mut text = String::from_utf8_lossy(bytes).into_owned();
        if text.len() > self.cap {
            let mut start = text.len() - self.cap;
            while !text.is_char_boundary(start) {
                start += 1;
            }
            text.drain(..start);
            self.truncated = true;
        }
        self.text_bytes += text.len();
        self.kept.push_back(Line { stream, text });
        while self.text_bytes > self.cap {
            let Some(old) = self.kept.pop_front() else {
                break;
            };
            self.text_bytes -= old.text.len();
            self.truncated = true;
        }
    }

    /// Marks the result as cut short (the stream was not read to its end).
    pub fn cut_short(&mut self) {
        self.truncated = true;
    }

    /// The kept lines, unfinished lines last (stdout's, then stderr's), and whether any
    /// text was dropped.
    pub fn finish(mut self) -> (Vec<Line>, bool) {
        for stream in [Stream::Stdout, Stream::Stderr] {
            let line = std::mem::take(&mut self.pending[stream.index()]);
            if !line.is_empty() {
                self.complete(stream, &line);
            }
        }
        (self.kept.into(), self.truncated)
    }
}

/// A log body read chunk by chunk: demultiplexed unless the container has a TTY.
#[derive(Debug)]
pub struct Collector {
    demux: Option<Demuxer>,
    lines: Lines,
    error: Option<FrameError>,
}

/// What a log body came to.
#[derive(Debug)]
pub struct Collected {
    pub lines: Vec<Line>,
    pub truncated: bool,
    /// The multiplexed stream was malformed or ended inside a frame.
    pub error: Option<FrameError>,
}

impl Collector {
    pub fn new(tty: bool, cap: usize) -> Self {
        Self {
            demux: (!tty).then(Demuxer::default),
            lines: Lines::new(cap),
            error: None,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        let Self {
            demux,
            lines,
            error,
        } = self;
        if error.is_some() {
            return;
        }
        match demux {
            None => lines.push(Stream::Stdout, chunk),
            Some(demux) => {
                if let Err(e) = demux.feed(chunk, &mut |stream, bytes| lines.push(stream, bytes)) {
                    *error = Some(e);
                }
            }
        }
    }

    pub fn cut_short(&mut self) {
        self.lines.cut_short();
    }

    pub fn finish(self) -> Collected {
        let error = self
            .error
            .or_else(|| self.demux.as_ref().and_then(|d| d.finish().err()));
        let (lines, truncated) = self.lines.finish();
        Collected {
            lines,
            truncated: truncated || error.is_some(),
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(stream: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![stream, 0, 0, 0];
        out.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn line(stream: Stream, text: &str) -> Line {
        Line {
            stream,
            text: text.into(),
        }
    }

    /// Feeds `body` to a collector in chunks of the given sizes (cycled).
    fn collect(tty: bool, cap: usize, body: &[u8], sizes: &[usize]) -> Collected {
        let mut c = Collector::new(tty, cap);
        let mut rest = body;
        let mut i = 0;
        while !rest.is_empty() {
            let n = sizes[i % sizes.len()].min(rest.len());
            c.feed(&rest[..n]);
            rest = &rest[n..];
            i += 1;
        }
        c.finish()
    }

    fn sample() -> (Vec<u8>, Vec<Line>) {
        let mut body = Vec::new();
        body.extend(frame(1, b"one\n"));
        body.extend(frame(2, b"err one\nerr two\n"));
        body.extend(frame(1, b"a line that "));
        body.extend(frame(2, b"interleaved\n"));
        body.extend(frame(1, b"spans frames\r\n"));
        body.extend(frame(0, b"stdin goes to stdout\n"));
        body.extend(frame(1, b"caf\xc3"));
        body.extend(frame(1, b"\xa9 \x00\xff\n"));
        body.extend(frame(1, b""));
        body.extend(frame(1, b"\n"));
        body.extend(frame(2, b"no newline at the end"));
        let expected = vec![
            line(Stream::Stdout, "one"),
            line(Stream::Stderr, "err one"),
            line(Stream::Stderr, "err two"),
            line(Stream::Stderr, "interleaved"),
            line(Stream::Stdout, "a line that spans frames"),
            line(Stream::Stdout, "stdin goes to stdout"),
            line(Stream::Stdout, "café \u{0}\u{fffd}"),
            line(Stream::Stdout, ""),
            line(Stream::Stderr, "no newline at the end"),
        ];
        (body, expected)
    }

    #[test]
    fn every_chunking_gives_the_same_lines() {
        let (body, expected) = sample();
        assert!(!expected.is_empty());
        // Whole, byte by byte, and boundaries inside headers and payloads.
        for sizes in [
            vec![body.len()],
            vec![1],
            vec![3],
            vec![5, 11],
            vec![7, 1, 13, 2, 8],
        ] {
            let got = collect(false, 1 << 20, &body, &sizes);
            assert_eq!(got.lines, expected, "chunk sizes {sizes:?}");
            assert!(!got.truncated, "chunk sizes {sizes:?}");
            assert_eq!(got.error, None, "chunk sizes {sizes:?}");
        }
    }

    #[test]
    fn a_header_split_in_every_place_is_reassembled() {
        let body = frame(2, b"split\n");
        for at in 1..HEADER_LEN {
            let mut seen = Vec::new();
            let mut d = Demuxer::default();
            let mut out = |s: Stream, b: &[u8]| seen.push((s, b.to_vec()));
            d.feed(&body[..at], &mut out).unwrap();
            d.feed(&body[at..], &mut out).unwrap();
            d.finish().unwrap();
            assert_eq!(
                seen,
                vec![(Stream::Stderr, b"split\n".to_vec())],
                "split at {at}"
            );
        }
    }

    #[test]
    fn payload_pieces_keep_their_stream() {
        let mut body = frame(1, b"abcdef");
        body.extend(frame(2, b"xyz"));
        let mut seen = Vec::new();
        let mut d = Demuxer::default();
        for piece in [&body[..10], &body[10..12], &body[12..]] {
            d.feed(piece, &mut |s, b| seen.push((s, b.to_vec())))
                .unwrap();
        }
        d.finish().unwrap();
        assert_eq!(
            seen,
            vec![
                (Stream::Stdout, b"ab".to_vec()),
                (Stream::Stdout, b"cd".to_vec()),
                (Stream::Stdout, b"ef".to_vec()),
                (Stream::Stderr, b"xyz".to_vec()),
            ]
        );
    }

    #[test]
    fn a_truncated_final_frame_is_reported_with_what_arrived() {
        let mut body = frame(1, b"whole\n");
        body.extend(frame(2, b"cut off here\n"));
        body.truncate(body.len() - 5);
        let got = collect(false, 1 << 20, &body, &[4]);
        assert_eq!(
            got.error,
            Some(FrameError::TruncatedPayload {
                missing: 5,
                len: 13
            })
        );
        assert!(got.truncated);
        assert_eq!(
            got.lines,
            vec![
                line(Stream::Stdout, "whole"),
                line(Stream::Stderr, "cut off ")
            ]
        );

        let mut body = frame(1, b"whole\n");
        body.extend_from_slice(&[2, 0, 0]);
        let got = collect(false, 1 << 20, &body, &[100]);
        assert_eq!(got.error, Some(FrameError::TruncatedHeader { got: 3 }));
        assert_eq!(got.lines, vec![line(Stream::Stdout, "whole")]);
    }

    #[test]
    fn an_unknown_stream_type_stops_the_demultiplexer() {
        let mut body = frame(1, b"fine\n");
        body.extend(frame(7, b"what\n"));
        body.extend(frame(1, b"never read\n"));
        let got = collect(false, 1 << 20, &body, &[6]);
        assert_eq!(got.error, Some(FrameError::BadStream(7)));
        assert_eq!(got.lines, vec![line(Stream::Stdout, "fine")]);
        assert!(got.truncated);
    }

    #[test]
    fn a_tty_stream_is_raw_stdout() {
        // Starts with byte 2: demultiplexing it would misread it as a stderr header.
        let body = b"\x02tty line\r\nsecond\r\npartial";
        let got = collect(true, 1 << 20, body, &[3]);
        assert_eq!(
            got.lines,
            vec![
                line(Stream::Stdout, "\u{2}tty line"),
                line(Stream::Stdout, "second"),
                line(Stream::Stdout, "partial"),
            ]
        );
        assert_eq!(got.error, None);
        assert!(!got.truncated);
    }

    #[test]
    fn the_cap_keeps_the_newest_lines() {
        let mut body = Vec::new();
        for i in 0..100 {
            body.extend(frame(1 + (i % 2), format!("line {i:03}\n").as_bytes()));
        }
        // Each line is 8 bytes of text; 80 bytes keep the last ten.
        let got = collect(false, 80, &body, &[9]);
        assert!(got.truncated);
        assert_eq!(got.error, None);
        let texts: Vec<&str> = got.lines.iter().map(|l| l.text.as_str()).collect();
        let expected: Vec<String> = (90..100).map(|i| format!("line {i:03}")).collect();
        assert_eq!(texts, expected);
        assert_eq!(got.lines[9].stream, Stream::Stderr);
    }

    #[test]
    fn an_overlong_line_keeps_its_end() {
        let mut long = "é".repeat(100).into_bytes();
        long.extend_from_slice(b"END\n");
        let got = collect(false, 51, &frame(1, &long), &[7]);
        assert!(got.truncated);
        assert_eq!(got.lines.len(), 1);
        let text = &got.lines[0].text;
        assert!(text.len() <= 51 && text.ends_with("éEND"), "{text:?}");

        // A line that never ends stays bounded while it streams in.
        let mut lines = Lines::new(10);
        for _ in 0..1000 {
            lines.push(Stream::Stdout, b"0123456789");
            assert!(lines.pending[0].len() <= 20);
        }
        let (kept, truncated) = lines.finish();
        assert!(truncated);
        assert_eq!(kept, vec![line(Stream::Stdout, "0123456789")]);
    }
}
