//! Strict base64url without padding (RFC 7515 §2), for reading a JWS header before any
//! key is chosen.
//!
//! Strict means: only `A–Z a–z 0–9 - _`, no `=`, no whitespace, no length of 4n+1, and
//! the unused low bits of the last character must be zero (one encoding per value).

/// The base64url alphabet value of `c`, or `None` outside it.
fn value(c: u8) -> Option<u32> {
    let v = match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'-' => 62,
        b'_' => 63,
        _ => return None,
    };
    Some(u32::from(v))
}

/// Whether every byte is in the base64url alphabet (no padding).
pub(crate) fn is_alphabet(s: &[u8]) -> bool {
    s.iter().all(|&c| value(c).is_some())
}

/// Decode strict base64url without padding; `None` if `s` is not exactly that.
pub(crate) fn decode(s: &[u8]) -> Option<Vec<u8>> {
    if s.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3 + 2);
    for chunk in s.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= value(c)? << (18 - 6 * i);
        }
        let [_, b0, b1, b2] = acc.to_be_bytes();
        match chunk.len() {
            4 => out.extend_from_slice(&[b0, b1, b2]),
            3 if b2 == 0 => out.extend_from_slice(&[b0, b1]),
            2 if b1 == 0 && b2 == 0 => out.push(b0),
            _ => return None,
        }
    }
    Some(out)
}

/// Encode as base64url without padding (tests mint tokens with it).
#[cfg(test)]
pub(crate) fn encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let mut acc = 0u32;
        for (i, &b) in chunk.iter().enumerate() {
            acc |= u32::from(b) << (16 - 8 * i);
        }
        for i in 0..=chunk.len() {
            let index = (acc >> (18 - 6 * i)) & 0x3f;
            out.push(char::from(ALPHABET[index as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_length() {
        let data: Vec<u8> = (0..=255u8).collect();
        for n in 0..40 {
            let encoded = encode(&data[..n]);
            assert!(!encoded.contains('='));
            assert_eq!(
                decode(encoded.as_bytes()).as_deref(),
                Some(&data[..n]),
                "n = {n}"
            );
        }
    }

    #[test]
    fn known_vectors() {
        assert_eq!(encode(b"f"), "Zg");
        assert_eq!(encode(b"fo"), "Zm8");
        assert_eq!(encode(b"foo"), "Zm9v");
        assert_eq!(encode(&[0xfb, 0xff]), "-_8");
        assert_eq!(decode(b"-_8").unwrap(), vec![0xfb, 0xff]);
    }

    #[test]
    fn refuses_everything_not_strict() {
        for bad in [
            &b"Zg=="[..], // padding
            b"Zm9v+/",    // standard alphabet
            b"Zm9 v",     // whitespace
            b"Zm9vZ",     // length 4n+1
            b"Zh",        // non-zero trailing bits
            b"Zm9",       // non-zero trailing bits
        ] {
            assert_eq!(decode(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(is_alphabet(b"abc-_09"));
        assert!(!is_alphabet(b"ab=c"));
    }
}
