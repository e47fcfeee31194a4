//! The DNS messages of ztunnel's DNS proxy (RFC 1035, the small part a stub
//! resolver uses), hand-written and bounds-checked.
//!
//! The double's side: [`parse_query`] reads a query's header and first
//! question without allocating, and [`write_response`] appends the answer to
//! a reused buffer. The tests' side: [`encode_query`] builds a query and
//! [`Response::parse`] reads what came back, so a test can check that an
//! app's query was answered by the double:
//!
//! ```no_run
//! # use ambpf_testbed::ztunnel::{DEFAULT_DNS_ANSWER_V4, dns};
//! # fn f(socket: &std::net::UdpSocket) -> std::io::Result<()> {
//! let query = dns::encode_query(7, "example.com", dns::TYPE_A).unwrap();
//! socket.send_to(&query, "10.96.0.10:53")?;
//! let mut buffer = [0u8; 512];
//! let (len, from) = socket.recv_from(&mut buffer)?;
//! assert_eq!(from, "10.96.0.10:53".parse().unwrap(), "from the resolver asked");
//! let response = dns::Response::parse(&buffer[..len]).unwrap();
//! assert_eq!(response.header.id, 7);
//! assert_eq!(response.addresses(), [DEFAULT_DNS_ANSWER_V4]);
//! # Ok(()) }
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
pub const CLASS_IN: u16 = 1;
pub const CLASS_ANY: u16 = 255;
pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NOTIMP: u8 = 4;
/// The fixed header of every message.
pub const HEADER_LEN: usize = 12;
/// A name's longest wire form, length octets and root label included.
pub const MAX_NAME_LEN: usize = 255;
pub const MAX_LABEL_LEN: usize = 63;
/// TTL of every answer the double gives.
pub const ANSWER_TTL: u32 = 30;

pub const FLAG_QR: u16 = 0x8000;
pub const FLAG_AA: u16 = 0x0400;
pub const FLAG_TC: u16 = 0x0200;
pub const FLAG_RD: u16 = 0x0100;
pub const FLAG_RA: u16 = 0x0080;
const OPCODE_MASK: u16 = 0x7800;
const OPCODE_SHIFT: u16 = 11;
const RCODE_MASK: u16 = 0x000f;
/// The top two bits of a length octet: `00` a label, `11` a pointer.
const LABEL_KIND_MASK: u8 = 0xc0;
const POINTER: u8 = 0xc0;
/// Pointers followed while reading one name (responses only).
const MAX_POINTER_HOPS: usize = 64;
/// Where the question's name starts; what an answer's name points to.
const QUESTION_NAME_POINTER: [u8; 2] = [0xc0, HEADER_LEN as u8];

/// A message header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub id: u16,
    pub flags: u16,
    pub qdcount: u16,
    pub ancount: u16,
    pub nscount: u16,
    pub arcount: u16,
}

impl Header {
    /// The header at the start of `message`, if it is that long.
    pub fn parse(message: &[u8]) -> Option<Self> {
        let header = message.get(..HEADER_LEN)?;
        let word = |i: usize| u16::from_be_bytes([header[i], header[i + 1]]);
        Some(Self {
            id: word(0),
            flags: word(2),
            qdcount: word(4),
            ancount: word(6),
            nscount: word(8),
            arcount: word(10),
        })
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        for word in [
            self.id,
            self.flags,
            self.qdcount,
            self.ancount,
            self.nscount,
            self.arcount,
        ] {
            out.extend_from_slice(&word.to_be_bytes());
        }
    }

    pub fn is_response(&self) -> bool {
        self.flags & FLAG_QR != 0
    }

    /// 0 is a standard query.
    pub fn opcode(&self) -> u8 {
        ((self.flags & OPCODE_MASK) >> OPCODE_SHIFT) as u8
    }

    pub fn rcode(&self) -> u8 {
        (self.flags & RCODE_MASK) as u8
    }
}

/// The first question of a query, borrowed from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Question<'a> {
    /// The name's wire form, root label included (no pointers).
    name: &'a [u8],
    /// Name, type and class as received: copied into the response.
    entry: &'a [u8],
    pub(super) qtype: u16,
    pub(super) qclass: u16,
}

impl Question<'_> {
    /// The name in presentation form, without the final dot (`.` for the
    /// root); `.` and `\` within labels and bytes other than printable ASCII
    /// escaped as `\.`, `\\` and `\DDD`.
    pub(super) fn name(&self) -> String {
        let mut text = String::with_capacity(self.name.len());
        let mut labels = Labels {
            message: self.name,
            position: 0,
        };
        // The name was checked by `name_end`: no pointers, nothing missing.
        while let Some(Ok(Label::Text(label))) = labels.next() {
            if !text.is_empty() {
                text.push('.');
            }
            push_label(&mut text, label);
        }
        if text.is_empty() {
            text.push('.');
        }
        text
    }
}

/// What to do with a message received by the DNS proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Parsed<'a> {
    /// A standard query: answer it.
    Query(Header, Question<'a>),
    /// Answer with this response code and no question.
    Reject(Header, u8),
}

/// Reads a query's header and first question. `None` for a message to drop
/// without a word: shorter than a header, or a response (answering those
/// could make two servers talk to each other forever).
pub(super) fn parse_query(message: &[u8]) -> Option<Parsed<'_>> {
    let header = Header::parse(message)?;
    if header.is_response() {
        return None;
    }
    if header.opcode() != 0 {
        return Some(Parsed::Reject(header, RCODE_NOTIMP));
    }
    if header.qdcount == 0 {
        return Some(Parsed::Reject(header, RCODE_FORMERR));
    }
    let Ok(name_end) = name_end(message, HEADER_LEN) else {
        return Some(Parsed::Reject(header, RCODE_FORMERR));
    };
    let Some(&[t0, t1, c0, c1]) = message.get(name_end..name_end + 4) else {
        return Some(Parsed::Reject(header, RCODE_FORMERR));
    };
    Some(Parsed::Query(
        header,
        Question {
            name: &message[HEADER_LEN..name_end],
            entry: &message[HEADER_LEN..name_end + 4],
            qtype: u16::from_be_bytes([t0, t1]),
            qclass: u16::from_be_bytes([c0, c1]),
        },
    ))
}

/// Appends the response to `query` to `out`: QR and RA set, opcode and RD
/// copied, `question` (if any) copied as received, and `answer` (if any) as
/// one record of the question's name, class IN, TTL [`ANSWER_TTL`].
pub(super) fn write_response(
    query: &Header,
    question: Option<&Question<'_>>,
    rcode: u8,
    answer: Option<IpAddr>,
    out: &mut Vec<u8>,
) {
    // Without a question there is no name to answer for.
    let answer = answer.filter(|_| question.is_some());
    Header {
        id: query.id,
        flags: FLAG_QR
            | (query.flags & (OPCODE_MASK | FLAG_RD))
            | FLAG_RA
            | (u16::from(rcode) & RCODE_MASK),
        qdcount: u16::from(question.is_some()),
        ancount: u16::from(answer.is_some()),
        nscount: 0,
        arcount: 0,
    }
    .write(out);
    if let Some(question) = question {
        out.extend_from_slice(question.entry);
    }
    if let Some(address) = answer {
        let (rtype, data_len) = match address {
            IpAddr::V4(_) => (TYPE_A, 4u16),
            IpAddr::V6(_) => (TYPE_AAAA, 16),
        };
        out.extend_from_slice(&QUESTION_NAME_POINTER);
        out.extend_from_slice(&rtype.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ANSWER_TTL.to_be_bytes());
        out.extend_from_slice(&data_len.to_be_bytes());
        match address {
            IpAddr::V4(v4) => out.extend_from_slice(&v4.octets()),
            IpAddr::V6(v6) => out.extend_from_slice(&v6.octets()),
        }
    }
}

/// Where the name starting at `start` ends (just past its root label). Only
/// plain labels: a pointer (not expected in a query's question) or a
/// reserved label type is refused, as is a name longer than
/// [`MAX_NAME_LEN`] or one running past the end of the message.
fn name_end(message: &[u8], start: usize) -> Result<usize, &'static str> {
    let mut position = start;
    loop {
        let &len = message.get(position).ok_or("name runs past the message")?;
        if len & LABEL_KIND_MASK == POINTER {
            return Err("compressed name");
        }
        if len & LABEL_KIND_MASK != 0 {
            return Err("reserved label type");
        }
        let next = position + 1 + usize::from(len);
        if next - start > MAX_NAME_LEN {
            return Err("name longer than 255 octets");
        }
        if len == 0 {
            return Ok(next);
        }
        if next > message.len() {
            return Err("label runs past the message");
        }
        position = next;
    }
}

enum Label<'a> {
    Text(&'a [u8]),
    /// Where a pointer leads.
    Pointer(usize),
}

/// The labels of a name, until its root label (`None`) or an error; a
/// pointer is returned for the caller to follow or not. Never reads out of
/// bounds.
struct Labels<'a> {
    message: &'a [u8],
    position: usize,
}

impl<'a> Iterator for Labels<'a> {
    type Item = Result<Label<'a>, String>;

    fn next(&mut self) -> Option<Self::Item> {
        let Some(&len) = self.message.get(self.position) else {
            return Some(Err("name runs past the message".to_owned()));
        };
        let start = self.position + 1;
        match len & LABEL_KIND_MASK {
            0 if len == 0 => {
                self.position = start;
                None
            }
            0 => {
                let end = start + usize::from(len);
                let Some(label) = self.message.get(start..end) else {
                    return Some(Err("label runs past the message".to_owned()));
                };
                self.position = end;
                Some(Ok(Label::Text(label)))
            }
            POINTER => {
                let Some(&low) = self.message.get(start) else {
                    return Some(Err("pointer runs past the message".to_owned()));
                };
                self.position = start + 1;
                let target = usize::from(u16::from_be_bytes([len & !LABEL_KIND_MASK, low]));
                Some(Ok(Label::Pointer(target)))
            }
            _ => Some(Err(format!("reserved label type {len:#04x}"))),
        }
    }
}

/// Reads a name, following pointers; returns it in presentation form and
/// where the name ends at `start` (past its root label or first pointer).
fn read_name(message: &[u8], start: usize) -> Result<(String, usize), String> {
    let mut text = String::new();
    let mut wire_len = 1; // the root label
    let mut labels = Labels {
        message,
        position: start,
    };
    let mut end = None;
    let mut hops = 0;
    loop {
        match labels.next() {
            None => break,
            Some(Err(e)) => return Err(e),
            Some(Ok(Label::Text(label))) => {
                wire_len += 1 + label.len();
                if wire_len > MAX_NAME_LEN {
                    return Err("name longer than 255 octets".to_owned());
                }
                if !text.is_empty() {
                    text.push('.');
                }
                push_label(&mut text, label);
            }
            Some(Ok(Label::Pointer(target))) => {
                end.get_or_insert(labels.position);
                hops += 1;
                if hops > MAX_POINTER_HOPS {
                    return Err("too many compression pointers".to_owned());
                }
                labels.position = target;
            }
        }
    }
    if text.is_empty() {
        text.push('.');
    }
    Ok((text, end.unwrap_or(labels.position)))
}

fn push_label(text: &mut String, label: &[u8]) {
    for &byte in label {
        match byte {
            b'.' | b'\\' => {
                text.push('\\');
                text.push(char::from(byte));
            }
            0x21..=0x7e => text.push(char::from(byte)),
            _ => {
                text.push('\\');
                text.push(char::from(b'0' + byte / 100));
                text.push(char::from(b'0' + byte / 10 % 10));
                text.push(char::from(b'0' + byte % 10));
            }
        }
    }
}

/// `len` bytes at `position`, which moves past them.
fn fixed<'m>(message: &'m [u8], position: &mut usize, len: usize) -> Result<&'m [u8], String> {
    let bytes = message
        .get(*position..*position + len)
        .ok_or("record runs past the message")?;
    *position += len;
    Ok(bytes)
}

/// A standard query (RD set) for `name` (`example.com` or `example.com.`;
/// `.` is the root; no escapes), as a stub resolver sends it.
pub fn encode_query(id: u16, name: &str, qtype: u16) -> Result<Vec<u8>, String> {
    let mut message = Vec::with_capacity(HEADER_LEN + name.len() + 6);
    Header {
        id,
        flags: FLAG_RD,
        qdcount: 1,
        ..Header::default()
    }
    .write(&mut message);
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    if !trimmed.is_empty() {
        for label in trimmed.split('.') {
            if label.is_empty() || label.len() > MAX_LABEL_LEN {
                return Err(format!("{name:?}: labels are 1 to 63 octets"));
            }
            message.push(label.len() as u8);
            message.extend_from_slice(label.as_bytes());
        }
    }
    message.push(0);
    if message.len() - HEADER_LEN > MAX_NAME_LEN {
        return Err(format!("{name:?}: longer than 255 octets"));
    }
    message.extend_from_slice(&qtype.to_be_bytes());
    message.extend_from_slice(&CLASS_IN.to_be_bytes());
    Ok(message)
}

/// A question as read from a response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuestionEntry {
    /// Presentation form, no final dot.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
}

/// A resource record of the answer section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub name: String,
    pub rtype: u16,
    pub class: u16,
    pub ttl: u32,
    pub data: Vec<u8>,
}

impl Record {
    /// The address of an A or AAAA record.
    pub fn address(&self) -> Option<IpAddr> {
        match (self.rtype, self.data.as_slice()) {
            (TYPE_A, &[a, b, c, d]) => Some(Ipv4Addr::new(a, b, c, d).into()),
            (TYPE_AAAA, data) if data.len() == 16 => {
                let octets: [u8; 16] = data.try_into().ok()?;
                Some(Ipv6Addr::from(octets).into())
            }
            _ => None,
        }
    }
}

/// A response, as a test reads it: header, questions and answer records
/// (authority and additional sections are not read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub header: Header,
    pub questions: Vec<QuestionEntry>,
    pub answers: Vec<Record>,
}

impl Response {
    pub fn parse(message: &[u8]) -> Result<Self, String> {
        let header = Header::parse(message).ok_or("shorter than a DNS header")?;
        if !header.is_response() {
            return Err("QR is not set: not a response".to_owned());
        }
        let mut position = HEADER_LEN;
        let mut questions = Vec::new();
        for _ in 0..header.qdcount {
            let (name, end) = read_name(message, position)?;
            position = end;
            let fields = fixed(message, &mut position, 4)?;
            questions.push(QuestionEntry {
                name,
                qtype: u16::from_be_bytes([fields[0], fields[1]]),
                qclass: u16::from_be_bytes([fields[2], fields[3]]),
            });
        }
        let mut answers = Vec::new();
        for _ in 0..header.ancount {
            let (name, end) = read_name(message, position)?;
            position = end;
            let fields = fixed(message, &mut position, 10)?;
            let data_len = usize::from(u16::from_be_bytes([fields[8], fields[9]]));
            let record = Record {
                name,
                rtype: u16::from_be_bytes([fields[0], fields[1]]),
                class: u16::from_be_bytes([fields[2], fields[3]]),
                ttl: u32::from_be_bytes([fields[4], fields[5], fields[6], fields[7]]),
                data: Vec::new(),
            };
            let data = fixed(message, &mut position, data_len)?.to_vec();
            answers.push(Record { data, ..record });
        }
        Ok(Self {
            header,
            questions,
            answers,
        })
    }

    pub fn rcode(&self) -> u8 {
        self.header.rcode()
    }

    /// The addresses of the A and AAAA answers, in order.
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.answers.iter().filter_map(Record::address).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 53);

    fn query_bytes() -> Vec<u8> {
        encode_query(0x1234, "example.com", TYPE_A).unwrap()
    }

    fn parsed(message: &[u8]) -> (Header, Question<'_>) {
        match parse_query(message) {
            Some(Parsed::Query(header, question)) => (header, question),
            other => panic!("not a query: {other:?}"),
        }
    }

    fn rejected(message: &[u8]) -> u8 {
        match parse_query(message) {
            Some(Parsed::Reject(_, rcode)) => rcode,
            other => panic!("not rejected: {other:?}"),
        }
    }

    /// A query with `name` given in wire form.
    fn raw_query(name: &[u8]) -> Vec<u8> {
        let mut message = vec![0xab, 0xcd, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        message.extend_from_slice(name);
        message.extend_from_slice(&[0, 1, 0, 1]);
        message
    }

    fn respond(message: &[u8], answer: Option<IpAddr>) -> Vec<u8> {
        let mut out = Vec::new();
        match parse_query(message) {
            Some(Parsed::Query(header, question)) => {
                write_response(&header, Some(&question), RCODE_NOERROR, answer, &mut out);
            }
            Some(Parsed::Reject(header, rcode)) => {
                write_response(&header, None, rcode, None, &mut out);
            }
            None => {}
        }
        out
    }

    #[test]
    fn encoded_query_is_what_a_stub_resolver_sends() {
        assert_eq!(
            query_bytes(),
            b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\
              \x07example\x03com\x00\x00\x01\x00\x01"
        );
        assert_eq!(
            encode_query(1, "example.com.", TYPE_A).unwrap(),
            encode_query(1, "example.com", TYPE_A).unwrap()
        );
        assert_eq!(
            &encode_query(1, ".", TYPE_A).unwrap()[HEADER_LEN..],
            b"\x00\x00\x01\x00\x01"
        );
    }

    #[test]
    fn a_query_is_answered_with_id_question_and_one_record() {
        let query = query_bytes();
        let (header, question) = parsed(&query);
        assert_eq!(header.id, 0x1234);
        assert_eq!(question.name(), "example.com");
        assert_eq!((question.qtype, question.qclass), (TYPE_A, CLASS_IN));
        let response = respond(&query, Some(V4.into()));
        let mut expected = b"\x12\x34\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00".to_vec();
        expected.extend_from_slice(&query[HEADER_LEN..]);
        expected
            .extend_from_slice(b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x1e\x00\x04\x0a\x60\x00\x35");
        assert_eq!(response, expected);
    }

    #[test]
    fn aaaa_answer_reads_back() {
        let v6: Ipv6Addr = "fd00:96::53".parse().unwrap();
        let query = encode_query(7, "Svc.NS.svc.cluster.local", TYPE_AAAA).unwrap();
        let response = Response::parse(&respond(&query, Some(v6.into()))).unwrap();
        assert_eq!(response.header.id, 7);
        assert_eq!(response.rcode(), RCODE_NOERROR);
        assert_ne!(response.header.flags & FLAG_RA, 0);
        assert_ne!(response.header.flags & FLAG_RD, 0, "RD is copied");
        assert_eq!(response.header.flags & FLAG_AA, 0);
        assert_eq!(
            response.questions,
            [QuestionEntry {
                name: "Svc.NS.svc.cluster.local".to_owned(),
                qtype: TYPE_AAAA,
                qclass: CLASS_IN,
            }]
        );
        assert_eq!(response.answers.len(), 1);
        let record = &response.answers[0];
        assert_eq!(record.name, "Svc.NS.svc.cluster.local");
        assert_eq!(
            (record.rtype, record.class, record.ttl),
            (TYPE_AAAA, CLASS_IN, ANSWER_TTL)
        );
        assert_eq!(response.addresses(), [IpAddr::from(v6)]);
    }

    #[test]
    fn other_types_get_noerror_and_no_answer() {
        let query = encode_query(9, "example.com", 16).unwrap();
        let response = Response::parse(&respond(&query, None)).unwrap();
        assert_eq!(response.rcode(), RCODE_NOERROR);
        assert_eq!(response.questions.len(), 1);
        assert!(response.answers.is_empty());
    }

    #[test]
    fn only_the_first_question_is_answered_and_edns_is_ignored() {
        let mut query = encode_query(3, "a.example", TYPE_A).unwrap();
        query[5] = 2; // qdcount
        query[11] = 1; // arcount: an OPT record follows the questions
        query.extend_from_slice(b"\x01b\x07example\x00\x00\x1c\x00\x01");
        query.extend_from_slice(b"\x00\x00\x29\x04\xd0\x00\x00\x00\x00\x00\x00");
        let response = Response::parse(&respond(&query, Some(V4.into()))).unwrap();
        assert_eq!(response.header.qdcount, 1);
        assert_eq!(response.header.arcount, 0);
        assert_eq!(response.questions[0].name, "a.example");
        assert_eq!(response.addresses(), [IpAddr::from(V4)]);
    }

    #[test]
    fn truncated_queries_are_dropped_or_formerr() {
        let query = query_bytes();
        for len in 0..query.len() {
            let truncated = &query[..len];
            if len < HEADER_LEN {
                assert_eq!(parse_query(truncated), None, "{len} bytes");
            } else {
                assert_eq!(rejected(truncated), RCODE_FORMERR, "{len} bytes");
                let response = Response::parse(&respond(truncated, None)).unwrap();
                assert_eq!(response.header.id, 0x1234);
                assert_eq!(response.rcode(), RCODE_FORMERR);
                assert!(response.questions.is_empty() && response.answers.is_empty());
                assert_ne!(response.header.flags & FLAG_RD, 0);
            }
        }
        parsed(&query);
    }

    #[test]
    fn responses_are_dropped_other_opcodes_not_implemented() {
        let mut message = query_bytes();
        message[2] |= 0x80; // QR
        assert_eq!(parse_query(&message), None);
        let mut status = query_bytes();
        status[2] = 0x10; // opcode 2 (STATUS)
        assert_eq!(rejected(&status), RCODE_NOTIMP);
        let response = Response::parse(&respond(&status, None)).unwrap();
        assert_eq!(response.header.opcode(), 2);
        assert_eq!(response.rcode(), RCODE_NOTIMP);
        let mut no_question = query_bytes();
        no_question[5] = 0;
        assert_eq!(rejected(&no_question), RCODE_FORMERR);
    }

    #[test]
    fn compressed_names_and_reserved_label_types_are_formerr() {
        for name in [
            &b"\xc0\x0c"[..],   // pointer to itself
            b"\xc0\x00",        // pointer into the header
            b"\x03www\xc0\x0c", // label then pointer
            b"\xff\xff",        // pointer past the end
            b"\x40abc\x00",     // extended label type
            b"\x80abc\x00",     // reserved label type
            b"\x05abc",         // label past the end
        ] {
            assert_eq!(rejected(&raw_query(name)), RCODE_FORMERR, "{name:?}");
        }
        // A lone pointer byte at the very end.
        let mut message = raw_query(b"");
        message.truncate(HEADER_LEN);
        message.push(0xc0);
        assert_eq!(rejected(&message), RCODE_FORMERR);
    }

    #[test]
    fn labels_of_63_and_names_of_255_octets_are_the_limits() {
        let label63 = "a".repeat(MAX_LABEL_LEN);
        let query = encode_query(1, &label63, TYPE_A).unwrap();
        assert_eq!(parsed(&query).1.name(), label63);
        // 3 × (1 + 63) + (1 + 61) + root = 255 octets.
        let longest = format!("{label63}.{label63}.{label63}.{}", "b".repeat(61));
        let query = encode_query(1, &longest, TYPE_A).unwrap();
        assert_eq!(query.len(), HEADER_LEN + MAX_NAME_LEN + 4);
        assert_eq!(parsed(&query).1.name(), longest);
        let response = Response::parse(&respond(&query, Some(V4.into()))).unwrap();
        assert_eq!(response.answers[0].name, longest);

        let too_long = format!("{longest}b");
        assert!(encode_query(1, &too_long, TYPE_A).is_err());
        assert!(encode_query(1, &format!("{label63}a"), TYPE_A).is_err());
        assert!(encode_query(1, "a..b", TYPE_A).is_err());
        // The same, crafted by hand for the parser.
        let mut wire = Vec::new();
        for len in [63u8, 63, 63, 62] {
            wire.push(len);
            wire.extend(std::iter::repeat_n(b'x', usize::from(len)));
        }
        wire.push(0);
        assert_eq!(wire.len(), MAX_NAME_LEN + 1);
        assert_eq!(rejected(&raw_query(&wire)), RCODE_FORMERR);
        // 64 has the top bits 01: not a label length.
        let mut label64 = vec![64u8];
        label64.extend(std::iter::repeat_n(b'x', 64));
        label64.push(0);
        assert_eq!(rejected(&raw_query(&label64)), RCODE_FORMERR);
    }

    #[test]
    fn names_are_recorded_in_presentation_form() {
        let message = raw_query(b"\x07a.b\\c \xff\x03com\x00");
        let (_, question) = parsed(&message);
        assert_eq!(question.name(), r"a\.b\\c\032\255.com");
        assert_eq!(parsed(&raw_query(b"\x00")).1.name(), ".");
    }

    #[test]
    fn malformed_responses_are_errors_not_panics() {
        let query = query_bytes();
        let response = respond(&query, Some(V4.into()));
        for len in 0..response.len() {
            assert!(Response::parse(&response[..len]).is_err(), "{len} bytes");
        }
        // An answer whose name points to itself.
        let mut looping = response.clone();
        let answer_name = HEADER_LEN + query.len() - HEADER_LEN;
        looping[answer_name..answer_name + 2]
            .copy_from_slice(&[0xc0, u8::try_from(answer_name).unwrap()]);
        assert!(Response::parse(&looping).is_err());
        // A pointer chain that grows the name past 255 octets.
        let mut long = b"\x12\x34\x81\x80\x00\x01\x00\x00\x00\x00\x00\x00".to_vec();
        long.push(63);
        long.extend(std::iter::repeat_n(b'x', 63));
        long.extend_from_slice(&[0xc0, 12]);
        assert!(Response::parse(&long).is_err());
        assert!(Response::parse(&query).is_err(), "a query is no response");
    }

    /// Pseudo-random messages: nothing panics, and every response the double
    /// would send reads back with the query's id.
    #[test]
    fn random_messages_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let seed = query_bytes();
        for round in 0..20_000 {
            let mut message = if round % 2 == 0 {
                seed.clone()
            } else {
                let len = (next() % 48) as usize;
                let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                if bytes.len() > 5 {
                    bytes[2] &= 0x07; // mostly queries, opcode 0
                    bytes[4] = 0;
                    bytes[5] = 1;
                }
                bytes
            };
            for _ in 0..(next() % 4) {
                if !message.is_empty() {
                    let at = (next() as usize) % message.len();
                    message[at] = next() as u8;
                }
            }
            let response = respond(&message, Some(V4.into()));
            if response.is_empty() {
                continue;
            }
            let read = Response::parse(&response)
                .unwrap_or_else(|e| panic!("{message:02x?} -> {response:02x?}: {e}"));
            assert_eq!(read.header.id, Header::parse(&message).unwrap().id);
            let _ = Response::parse(&message);
        }
    }
}
