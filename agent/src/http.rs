//! The agent's deliberately small HTTP/1.1 responder, shared by the health
//! and metrics endpoints (TCP) and the CNI endpoint (unix socket): one
//! request per connection, answered, then closed. A handful of fixed paths
//! does not warrant an HTTP server framework.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt as _};

/// One request: method, path (query dropped) and body.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
}

/// Reads one request, its body by content-length; a head or a body larger
/// than `max` bytes is refused.
pub async fn read_request(conn: &mut (impl AsyncRead + Unpin), max: usize) -> io::Result<Request> {
    let invalid = |msg: &str| io::Error::new(io::ErrorKind::InvalidData, msg.to_owned());
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > max {
            return Err(invalid("request head too large"));
        }
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Err(invalid("incomplete request"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut words = lines.next().unwrap_or_default().split_whitespace();
    let (method, path) = match (words.next(), words.next()) {
        (Some(m), Some(p)) => (m.to_owned(), p.split('?').next().unwrap_or(p).to_owned()),
        _ => return Err(invalid("malformed request line")),
    };
    let mut length = 0usize;
    for line in lines {
        if let Some((name, value)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            length = value
                .trim()
                .parse()
                .map_err(|_| invalid("bad content-length"))?;
        }
    }
    if length > max {
        return Err(invalid("request body too large"));
    }
    let mut body = buf.split_off(head_end);
    while body.len() < length {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Err(invalid("incomplete body"));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(Request { method, path, body })
}

/// A complete response that closes the connection.
pub fn response(status: u16, content_type: &str, body: &str) -> String {
    response_head(status, content_type, body.len()) + body
}

/// The status line and headers of a response of `length` bytes that closes
/// the connection (a large body is then written as it is, not copied).
pub fn response_head(status: u16, content_type: &str, length: usize) -> String {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {length}\r\nconnection: close\r\n\r\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_is_read_by_content_length_and_the_query_dropped() {
        let raw = b"POST /cmdadd?x=1 HTTP/1.1\r\nContent-Length: 4\r\n\r\nbodyEXTRA";
        let request = read_request(&mut &raw[..], 1024).await.unwrap();
        assert_eq!(
            (request.method.as_str(), request.path.as_str()),
            ("POST", "/cmdadd")
        );
        assert_eq!(request.body, b"body");
        let incomplete = b"GET / HTTP/1.1\r\n";
        assert!(read_request(&mut &incomplete[..], 1024).await.is_err());
        let too_long = b"POST / HTTP/1.1\r\ncontent-length: 1025\r\n\r\n";
        assert!(read_request(&mut &too_long[..], 1024).await.is_err());
        let head_too_long = [b'x'; 2048];
        assert!(read_request(&mut &head_too_long[..], 1024).await.is_err());
    }

    #[test]
    fn responses_carry_their_length_and_close() {
        assert_eq!(
            response(503, "text/plain", "wait\n"),
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 5\r\nconnection: close\r\n\r\nwait\n"
        );
    }
}
