//! Captured request headers, as an operator pastes them: `Name: value` lines, optionally with a
//! request line (`POST /webhooks/x HTTP/1.1`) and curl's `> ` prefixes.

use http::{HeaderMap, HeaderName, HeaderValue};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CaptureError(pub String);

/// Parses header lines. Blank lines, a request line and `> ` prefixes are skipped.
pub fn parse_headers(text: &str) -> Result<HeaderMap, CaptureError> {
    let mut headers = HeaderMap::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim_end_matches('\r');
        let line = line.strip_prefix("> ").unwrap_or(line).trim();
        if line.is_empty() || line.contains(" HTTP/") || line.starts_with("HTTP/") {
            continue;
        }
        append(&mut headers, line).map_err(|e| CaptureError(format!("line {}: {}", n + 1, e.0)))?;
    }
    Ok(headers)
}

/// Adds one `Name: value` header.
pub fn append(headers: &mut HeaderMap, line: &str) -> Result<(), CaptureError> {
    let (name, value) = line.split_once(':').ok_or_else(|| {
        CaptureError(format!(
            "{:?} is not `Name: value`",
            line.chars().take(40).collect::<String>()
        ))
    })?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| CaptureError(format!("bad header name {:?}", name.trim())))?;
    let value = HeaderValue::from_str(value.trim())
        .map_err(|_| CaptureError(format!("bad value for {name}")))?;
    headers.append(name, value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_curl_verbose_and_raw_captures() {
        let text = "> POST /webhooks/gh HTTP/1.1\r\n> Host: x\r\n> X-Hub-Signature-256: sha256=ab\r\n\r\nX-GitHub-Event: push\n";
        let h = parse_headers(text).unwrap();
        assert_eq!(h["x-hub-signature-256"], "sha256=ab");
        assert_eq!(h["x-github-event"], "push");
        assert_eq!(h.len(), 3);
        assert!(
            parse_headers("no colon here")
                .unwrap_err()
                .0
                .starts_with("line 1:")
        );
    }
}
