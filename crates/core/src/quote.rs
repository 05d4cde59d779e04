//! Names as users read them in listings, warnings and errors. btrfs names are any bytes
//! but '/' and NUL, so a crafted or careless name can carry a newline or a terminal
//! escape sequence; printed raw it forges extra lines or rewrites the screen. Every
//! name that reaches a message or a listing goes through `name` (or `path`) first.
//!
//! The escaping is C-style, like `ls -b`: `\n`, `\t`, `\r`, `\\` for a backslash, and
//! `\xNN` for every other control byte, DEL and each byte of invalid UTF-8. Valid
//! non-ASCII UTF-8 (accented letters, CJK) stays as it is, so ordinary names are
//! unchanged and the escaped form maps back to exactly one byte string.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Escape a name (or a path built of names) for display.
pub fn name(b: &[u8]) -> Cow<'_, str> {
    if let Ok(s) = std::str::from_utf8(b) {
        if !s.chars().any(needs_escape) {
            return Cow::Borrowed(s);
        }
    }
    let mut out = String::with_capacity(b.len() + 8);
    for chunk in b.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\n' => out.push_str("\\n"),
                '\t' => out.push_str("\\t"),
                '\r' => out.push_str("\\r"),
                '\\' => out.push_str("\\\\"),
                c if needs_escape(c) => {
                    let mut buf = [0u8; 4];
                    for byte in c.encode_utf8(&mut buf).bytes() {
                        let _ = write!(out, "\\x{byte:02x}");
                    }
                }
                c => out.push(c),
            }
        }
        for byte in chunk.invalid() {
            let _ = write!(out, "\\x{byte:02x}");
        }
    }
    Cow::Owned(out)
}

/// Escape a host path for display.
pub fn path(p: &std::path::Path) -> Cow<'_, str> {
    name(p.as_os_str().as_encoded_bytes())
}

fn needs_escape(c: char) -> bool {
    c.is_control() || c == '\\'
}

#[cfg(test)]
mod tests {
    use super::name;

    #[test]
    fn plain_names_are_unchanged() {
        for n in ["a", "file.txt", "ünïcødé", "日本語", "with space", "-dash"] {
            assert_eq!(name(n.as_bytes()), n);
        }
    }

    #[test]
    fn control_bytes_and_bad_utf8_are_escaped() {
        assert_eq!(name(b"a\nb"), "a\\nb");
        assert_eq!(name(b"tab\there"), "tab\\there");
        assert_eq!(name(b"cr\r"), "cr\\r");
        assert_eq!(name(b"back\\slash"), "back\\\\slash");
        assert_eq!(name(b"\x1b[31mred"), "\\x1b[31mred");
        assert_eq!(name(b"del\x7f"), "del\\x7f");
        assert_eq!(name(b"bad\xff\xfeutf8"), "bad\\xff\\xfeutf8");
        // A C1 control character (U+0085, NEL) is escaped byte by byte.
        assert_eq!(name("x\u{85}y".as_bytes()), "x\\xc2\\x85y");
        assert!(!name(b"a\nb").contains('\n'));
        assert_eq!(name(b"a\nb\\c\xff"), "a\\nb\\\\c\\xff");
        assert_eq!(name("caf\u{e9}".as_bytes()), "caf\u{e9}");
    }
}
