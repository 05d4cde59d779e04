//! `setfattr` and `getfattr` on an image, as attr's tools of the same names do on a
//! mounted filesystem: the same value encodings (text, `"quoted"` with backslash
//! escapes, `0x` hex, `0s` base64) and the same output (`# file: PATH`, then
//! `name="value"` lines, names sorted, a blank line). Paths inside the image are
//! absolute; `# file:` shows them without the leading `/`, as getfattr shows absolute
//! paths. `setfattr` changes every PATH in one transaction and one commit: when any
//! fails, nothing is committed.

use crate::{ImageArgs, WriteImageArgs};
use std::ffi::OsString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use ubtrfs_core::inode::filesystem::{Filesystem, InodeId};
use ubtrfs_core::{Error, FsRead, PosixKind, Result, XattrRead};

#[derive(clap::Subcommand)]
pub enum XattrCmd {
    /// Set or remove an extended attribute (like attr's setfattr; one atomic commit).
    Setfattr(SetfattrArgs),
    /// Print extended attributes (like attr's getfattr; without -m, only user.*).
    Getfattr(GetfattrArgs),
}

impl XattrCmd {
    pub fn run(&self) -> Result<()> {
        match self {
            XattrCmd::Setfattr(a) => setfattr(a),
            XattrCmd::Getfattr(a) => getfattr(a),
        }
    }
}

#[derive(clap::Args)]
#[command(disable_help_flag = true)]
#[command(group(clap::ArgGroup::new("op").required(true).args(["name", "remove"])))]
#[command(after_help = "\
VALUE is text as given; \"text in double quotes\" with \\\\, \\\" and \\ooo (octal) escapes;
0xHEX (pairs of hex digits); or 0sBASE64. Without -v the value is empty.")]
pub struct SetfattrArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Set the attribute NAME (with -v VALUE).
    #[arg(short = 'n', long = "name", value_name = "NAME")]
    pub name: Option<OsString>,
    /// The new value (see below for its encodings).
    #[arg(
        short = 'v',
        long = "value",
        value_name = "VALUE",
        requires = "name",
        allow_hyphen_values = true
    )]
    pub value: Option<OsString>,
    /// Remove the attribute NAME.
    #[arg(short = 'x', long = "remove", value_name = "NAME", conflicts_with = "name")]
    pub remove: Option<OsString>,
    /// Change a symlink itself, not what it points to.
    #[arg(short = 'h', long = "no-dereference")]
    pub no_dereference: bool,
    /// Absolute paths inside the image.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<String>,
    /// Print help.
    #[arg(long, action = clap::ArgAction::Help)]
    pub help: Option<bool>,
}

/// How getfattr shows values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Encoding {
    Text,
    Hex,
    Base64,
}

#[derive(clap::Args)]
#[command(disable_help_flag = true)]
#[command(after_help = "\
Without -n, the names matching -m are listed (with -d, with their values); the default
pattern is ^user\\. as getfattr's, and - or \"\" matches every name. Patterns take ^, $,
., * and backslash escapes (not the rest of extended regular expressions). Without -e a
value prints as \"text\" when at most one byte in eight is not printable ASCII (a final
NUL aside), else as 0sBASE64, as getfattr chooses.")]
pub struct GetfattrArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// Print only the attribute NAME, with its value.
    #[arg(short = 'n', long = "name", value_name = "NAME")]
    pub name: Option<OsString>,
    /// Print values too (names only otherwise).
    #[arg(short = 'd', long = "dump")]
    pub dump: bool,
    /// Only names matching PATTERN.
    #[arg(short = 'm', long = "match", value_name = "PATTERN", allow_hyphen_values = true)]
    pub pattern: Option<String>,
    /// Value encoding.
    #[arg(short = 'e', long = "encoding", value_enum)]
    pub encoding: Option<Encoding>,
    /// Read a symlink's own attributes, not its target's.
    #[arg(short = 'h', long = "no-dereference")]
    pub no_dereference: bool,
    /// Absolute paths inside the image.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<String>,
    /// Print help.
    #[arg(long, action = clap::ArgAction::Help)]
    pub help: Option<bool>,
}

fn absolute(p: &str) -> Result<()> {
    if p.starts_with('/') {
        Ok(())
    } else {
        Err(Error::posix_detail(PosixKind::Invalid, p, "paths inside the image are absolute"))
    }
}

pub fn setfattr(a: &SetfattrArgs) -> Result<()> {
    let (name, value) = match (&a.name, &a.remove) {
        (Some(n), None) => {
            let v = a
                .value
                .as_ref()
                .map(|v| decode_value(v.as_bytes()))
                .transpose()?
                .unwrap_or_default();
            (n.as_bytes(), Some(v))
        }
        (None, Some(n)) => (n.as_bytes(), None),
        _ => unreachable!("clap requires exactly one of -n and -x"),
    };
    for p in &a.paths {
        absolute(p)?;
    }
    let mut w = a.image.open_writer()?;
    crate::print_warnings(&w.info);
    for p in &a.paths {
        let r = (|| {
            let id = w.live().resolve_id(p, !a.no_dereference)?;
            match &value {
                Some(v) => w.setxattr(id, name, v, 0),
                None => w.removexattr(id, name),
            }
        })();
        // A failure after an earlier path changed leaves the transaction half done:
        // abort it, nothing is committed.
        r.map_err(|e| e.at(p.clone())).inspect_err(|e| w.abort("setfattr", e))?;
    }
    w.commit()?;
    Ok(())
}

pub fn getfattr(a: &GetfattrArgs) -> Result<()> {
    let fs = Filesystem::from_info(a.image.open()?)?;
    let pattern = match &a.name {
        Some(_) => None,
        None => Some(Pattern::new(a.pattern.as_deref().unwrap_or(r"^user\."))?),
    };
    let mut out = std::io::stdout().lock();
    for p in &a.paths {
        absolute(p)?;
        let id = fs.resolve_id(p, !a.no_dereference).map_err(|e| e.at(p.clone()))?;
        let lines = file_lines(&fs, id, a, pattern.as_ref()).map_err(|e| e.at(p.clone()))?;
        if lines.is_empty() {
            continue;
        }
        let mut text =
            format!("# file: {}\n", ubtrfs_core::quote::name(p.trim_start_matches('/').as_bytes()))
                .into_bytes();
        for l in lines {
            text.extend_from_slice(&l);
            text.push(b'\n');
        }
        text.push(b'\n');
        out.write_all(&text).map_err(|e| Error::io("stdout", e))?;
    }
    Ok(())
}

/// The lines getfattr prints for one inode (values as bytes: text encoding writes
/// them raw, as getfattr does; names go through `quote::name`).
fn file_lines(
    fs: &Filesystem,
    id: InodeId,
    a: &GetfattrArgs,
    pattern: Option<&Pattern>,
) -> Result<Vec<Vec<u8>>> {
    let show = |n: &[u8], v: &[u8]| {
        [format!("{}=", ubtrfs_core::quote::name(n)).into_bytes(), encode_value(v, a.encoding)]
            .concat()
    };
    if let Some(n) = &a.name {
        let v = fs.getxattr(id, n.as_bytes())?;
        return Ok(vec![show(n.as_bytes(), &v)]);
    }
    let pattern = pattern.expect("a pattern without -n");
    let mut names: Vec<Vec<u8>> =
        fs.listxattr(id)?.into_iter().filter(|n| pattern.matches(n)).collect();
    names.sort();
    let mut lines = Vec::with_capacity(names.len());
    for n in names {
        if a.dump {
            // Read as getxattr(2) would: a name the VFS hides from this inode is left out.
            match fs.getxattr(id, &n) {
                Ok(v) => lines.push(show(&n, &v)),
                Err(e)
                    if matches!(
                        e.posix_kind(),
                        Some(PosixKind::NoData | PosixKind::NotSupported)
                    ) => {}
                Err(e) => return Err(e),
            }
        } else {
            lines.push(ubtrfs_core::quote::name(&n).into_owned().into_bytes());
        }
    }
    Ok(lines)
}

/// A value in getfattr's encodings; `None`: as getfattr chooses, text when at most one
/// byte in eight is not printable ASCII (one final NUL aside, which text drops), else
/// base64.
pub fn encode_value(v: &[u8], enc: Option<Encoding>) -> Vec<u8> {
    let body = v.strip_suffix(b"\0").unwrap_or(v);
    let unprintable = body.iter().filter(|b| !(0x20..0x7f).contains(*b)).count();
    let enc = enc.unwrap_or(if body.len() >= unprintable * 8 {
        Encoding::Text
    } else {
        Encoding::Base64
    });
    match enc {
        Encoding::Text => {
            let mut s = b"\"".to_vec();
            for &b in body {
                match b {
                    0 | b'\n' | b'\r' => s.extend_from_slice(format!("\\{b:03o}").as_bytes()),
                    b'\\' | b'"' => s.extend_from_slice(&[b'\\', b]),
                    // Every other byte as it is, as getfattr writes it.
                    _ => s.push(b),
                }
            }
            s.push(b'"');
            s
        }
        Encoding::Hex => {
            let mut s = String::from("0x");
            for b in v {
                s.push_str(&format!("{b:02x}"));
            }
            s.into_bytes()
        }
        Encoding::Base64 => format!("0s{}", base64_encode(v)).into_bytes(),
    }
}

/// A value as setfattr takes it: `0x` hex, `0s` base64, `"quoted"` text with
/// `\\`, `\"` and `\ooo` escapes, or the bytes as given.
///
/// # Errors
/// `Posix(Invalid)` for a malformed hex or base64 value.
pub fn decode_value(s: &[u8]) -> Result<Vec<u8>> {
    let bad = |why: &str| {
        Error::posix_detail(
            PosixKind::Invalid,
            format!("value {}", ubtrfs_core::quote::name(s)),
            why.to_string(),
        )
    };
    match s {
        [b'0', b'x' | b'X', rest @ ..] => {
            let digits: Vec<u8> =
                rest.iter().copied().filter(|b| !b.is_ascii_whitespace()).collect();
            if !digits.len().is_multiple_of(2) {
                return Err(bad("an odd number of hex digits"));
            }
            digits
                .chunks(2)
                .map(|p| {
                    let h = |c: u8| {
                        (c as char)
                            .to_digit(16)
                            .ok_or_else(|| bad("a character that is not a hex digit"))
                    };
                    Ok((h(p[0])? * 16 + h(p[1])?) as u8)
                })
                .collect()
        }
        [b'0', b's' | b'S', rest @ ..] => base64_decode(rest).ok_or_else(|| bad("not base64")),
        [b'"', rest @ ..] => {
            let mut out = Vec::with_capacity(rest.len());
            let mut i = 0;
            while i < rest.len() && rest[i] != b'"' {
                if rest[i] == b'\\' && i + 1 < rest.len() {
                    let oct: Vec<u8> = rest[i + 1..]
                        .iter()
                        .take(3)
                        .take_while(|c| (b'0'..=b'7').contains(c))
                        .copied()
                        .collect();
                    if oct.is_empty() {
                        out.push(rest[i + 1]);
                        i += 2;
                    } else {
                        out.push(oct.iter().fold(0u32, |a, &d| a * 8 + u32::from(d - b'0')) as u8);
                        i += 1 + oct.len();
                    }
                } else {
                    out.push(rest[i]);
                    i += 1;
                }
            }
            Ok(out)
        }
        _ => Ok(s.to_vec()),
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(v: &[u8]) -> String {
    let mut s = String::with_capacity(v.len().div_ceil(3) * 4);
    for c in v.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                s.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

fn base64_decode(s: &[u8]) -> Option<Vec<u8>> {
    let digits: Vec<u8> = s.iter().copied().filter(|b| !b.is_ascii_whitespace()).collect();
    let body = digits.strip_suffix(b"==").or_else(|| digits.strip_suffix(b"=")).unwrap_or(&digits);
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for &c in body {
        let d = B64.iter().position(|&x| x == c)? as u32;
        acc = (acc << 6) | d;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    // Leftover bits must be zero padding, and padding only completes a group.
    if acc != 0 || (!digits.len().is_multiple_of(4) && digits.len() != body.len()) {
        return None;
    }
    Some(out)
}

/// The subset of extended regular expressions getfattr's -m takes here: `^`, `$`, `.`,
/// `*` after an atom, and backslash escapes; the name matches anywhere unless anchored.
pub struct Pattern(Vec<Atom>, bool, bool);

#[derive(Clone, Copy)]
enum Atom {
    Any,
    Byte(u8),
    Star(Option<u8>),
}

impl Pattern {
    /// # Errors
    /// `Posix(Invalid)` for the extended regular expression syntax not supported.
    pub fn new(p: &str) -> Result<Pattern> {
        if p == "-" || p.is_empty() {
            return Ok(Pattern(Vec::new(), false, false));
        }
        let b = p.as_bytes();
        let (start, b) = match b.strip_prefix(b"^") {
            Some(r) => (true, r),
            None => (false, b),
        };
        let (end, b) = match b.strip_suffix(b"$") {
            Some(r) if !r.ends_with(b"\\") => (true, r),
            _ => (false, b),
        };
        let mut atoms: Vec<Atom> = Vec::new();
        let mut i = 0;
        while i < b.len() {
            let a = match b[i] {
                b'\\' if i + 1 < b.len() => {
                    i += 1;
                    Atom::Byte(b[i])
                }
                b'.' => Atom::Any,
                b'*' => {
                    let prev = atoms.pop().ok_or_else(|| {
                        Error::posix_detail(
                            PosixKind::Invalid,
                            format!("pattern {p}"),
                            "* without an atom before it",
                        )
                    })?;
                    match prev {
                        Atom::Any => Atom::Star(None),
                        Atom::Byte(c) => Atom::Star(Some(c)),
                        Atom::Star(_) => {
                            return Err(Error::posix_detail(
                                PosixKind::Invalid,
                                format!("pattern {p}"),
                                "** is not supported",
                            ))
                        }
                    }
                }
                b'[' | b']' | b'(' | b')' | b'|' | b'+' | b'?' | b'{' | b'}' | b'^' | b'$'
                | b'\\' => {
                    return Err(Error::posix_detail(
                        PosixKind::Invalid,
                        format!("pattern {p}"),
                        "only ^, $, ., * and backslash escapes are supported",
                    ));
                }
                c => Atom::Byte(c),
            };
            atoms.push(a);
            i += 1;
        }
        Ok(Pattern(atoms, start, end))
    }

    pub fn matches(&self, name: &[u8]) -> bool {
        if self.1 {
            return match_here(&self.0, name, self.2);
        }
        (0..=name.len()).any(|i| match_here(&self.0, &name[i..], self.2))
    }
}

/// Kernighan and Pike's matcher: `atoms` at the start of `t`.
fn match_here(atoms: &[Atom], t: &[u8], end: bool) -> bool {
    let Some((&a, rest)) = atoms.split_first() else { return !end || t.is_empty() };
    match a {
        Atom::Star(c) => {
            let mut i = 0;
            loop {
                if match_here(rest, &t[i..], end) {
                    return true;
                }
                if i < t.len() && c.is_none_or(|c| t[i] == c) {
                    i += 1;
                } else {
                    return false;
                }
            }
        }
        Atom::Any => !t.is_empty() && match_here(rest, &t[1..], end),
        Atom::Byte(c) => t.first() == Some(&c) && match_here(rest, &t[1..], end),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_decode_as_setfattr_takes_them() {
        assert_eq!(decode_value(b"plain text").unwrap(), b"plain text");
        assert_eq!(decode_value(br#""quoted\101\\\"x""#).unwrap(), b"quotedA\\\"x");
        assert_eq!(decode_value(b"0x00ff0A41").unwrap(), [0, 0xff, 0x0a, 0x41]);
        assert_eq!(decode_value(b"0sAP8KQQ==").unwrap(), [0, 0xff, 0x0a, 0x41]);
        assert_eq!(decode_value(b"0s").unwrap(), b"");
        assert!(decode_value(b"0x123").is_err());
        assert!(decode_value(b"0xzz").is_err());
        assert!(decode_value(b"0s!!").is_err());
    }

    #[test]
    fn values_encode_as_getfattr_prints_them() {
        let encode_value = |v: &[u8], e| String::from_utf8(encode_value(v, e)).expect("ascii here");
        // Each as getfattr printed the kernel's value.
        assert_eq!(encode_value(&[0, 0xff, 0x0a, 0x41], None), "0sAP8KQQ==");
        assert_eq!(encode_value(b"hello \"w\" \\ x", None), r#""hello \"w\" \\ x""#);
        assert_eq!(encode_value(b"abc\0", None), "\"abc\"");
        assert_eq!(encode_value(b"a\rb", None), "0sYQ1i");
        assert_eq!(encode_value(b"", None), "\"\"");
        // One unprintable byte in eight or fewer stays text.
        assert_eq!(encode_value(b"a \"q\" \\ A\nend", None), r#""a \"q\" \\ A\012end""#);
        assert_eq!(encode_value(b"a\nb\tc", None), "0sYQpiCWM=");
        assert_eq!(encode_value(b"a\nb\tc", Some(Encoding::Text)), "\"a\\012b\tc\"");
        assert_eq!(encode_value(b"quotedA\\", Some(Encoding::Hex)), "0x71756f746564415c");
        assert_eq!(encode_value(b"", Some(Encoding::Base64)), "0s");
        for v in [&b""[..], b"a", b"ab", b"abc", b"abcd", &[0xff; 7]] {
            assert_eq!(base64_decode(base64_encode(v).as_bytes()).as_deref(), Some(v));
        }
    }

    #[test]
    fn patterns() {
        let m = |p: &str, n: &str| Pattern::new(p).unwrap().matches(n.as_bytes());
        assert!(
            m(r"^user\.", "user.a") && !m(r"^user\.", "trusted.user.a") && !m(r"^user\.", "userXa")
        );
        assert!(m("-", "security.selinux") && m("", "x"));
        assert!(m("z.$", "user.z3") && !m("z.$", "user.z34"));
        assert!(m("^b.*n$", "btrfs.compression") && m("comp", "btrfs.compression"));
        assert!(Pattern::new("a|b").is_err());
    }
}
