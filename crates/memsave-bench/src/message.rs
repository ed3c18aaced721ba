//! Errors users see: one line a person can act on, whatever libtorch or a panic said.
//!
//! libtorch's messages carry a C++ backtrace (`Exception raised from ... (most recent
//! call first):` and a list of `frame #N:` lines), and a panic from tch's
//! non-`f_` functions wraps the message in `Result::unwrap()`'s Debug output, which
//! escapes every line break and quote into one very long line. [`one_line`] undoes
//! the escaping, drops the backtrace, and keeps the first line that says something.

/// Cuts `text` down to its first meaningful line: unwraps `called
/// \`Result::unwrap()\` on an \`Err\` value: Torch("...")` into the message itself,
/// drops tch's `Internal torch error: ` prefix, everything from `Exception raised
/// from` on and any `frame #N:` line, trims, and names the Rust calls where libtorch
/// hints at Python's (`set_detect_anomaly`, `keep_graph`).
pub fn one_line(text: &str) -> String {
    let text = unwrap_debug(text).unwrap_or_else(|| text.to_owned());
    let text = text.replace("Internal torch error: ", "");
    let text = match text.find("Exception raised from") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("frame #"))
        .unwrap_or("unknown error");
    memsave_sys::in_rust_terms(line)
}

/// The message inside `called \`Result::unwrap()\` on an \`Err\` value: Variant("...")`,
/// with the Debug escapes undone; `None` when `text` is not of that form.
fn unwrap_debug(text: &str) -> Option<String> {
    const UNWRAP: &str = "called `Result::unwrap()` on an `Err` value: ";
    let at = text.find(UNWRAP)?;
    let before = &text[..at];
    let debug = text[at + UNWRAP.len()..].trim_end();
    let open = debug.find("(\"")?;
    if !debug[..open].chars().all(|c| c.is_ascii_alphanumeric()) || !debug.ends_with("\")") {
        return None;
    }
    let inner = unescape(&debug[open + 2..debug.len() - 2])?;
    Some(format!("{before}{inner}"))
}

/// Undoes Rust's `{:?}` string escapes (`\n`, `\"`, `\\`, `\u{..}`, ...).
fn unescape(escaped: &str) -> Option<String> {
    let mut out = String::with_capacity(escaped.len());
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next()? {
            'n' => out.push('\n'),
            'r' => out.push('\r'),
            't' => out.push('\t'),
            '0' => out.push('\0'),
            'u' => {
                if chars.next()? != '{' {
                    return None;
                }
                let hex: String = chars.by_ref().take_while(|&c| c != '}').collect();
                out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
            }
            other => out.push(other),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BACKTRACE: &str = "Exception raised from allocate at alloc.cpp:42 (most recent call first):\nframe #0: c10::Error::Error() + 0x9c (0x7f in libc10.so)\nframe #1: at::empty() + 0x1 (0x7f in libtorch_cpu.so)\n";

    #[test]
    fn a_debug_escaped_unwrap_becomes_the_message_alone() {
        let message = "memory limit of 1024 bytes exceeded: cannot allocate 1024 bytes \"here\"\n";
        let panic = format!(
            "called `Result::unwrap()` on an `Err` value: Torch({:?})",
            format!("{message}{BACKTRACE}")
        );
        assert!(panic.len() > message.len() + 100 && !panic.contains('\n'));
        assert_eq!(
            one_line(&panic),
            "memory limit of 1024 bytes exceeded: cannot allocate 1024 bytes \"here\""
        );
    }

    #[test]
    fn backtraces_and_frames_are_cut() {
        let text = format!("Internal torch error: shapes cannot be multiplied {BACKTRACE}");
        assert_eq!(one_line(&text), "shapes cannot be multiplied");
        assert_eq!(one_line("\nframe #3: x\n"), "unknown error");
    }

    #[test]
    fn plain_messages_keep_their_first_line() {
        assert_eq!(one_line("  first  \nsecond"), "first");
        assert_eq!(
            one_line("no unwrap: Torch(\"x\")"),
            "no unwrap: Torch(\"x\")"
        );
        assert_eq!(unescape("a\\u{e9}\\\\b"), Some("aé\\b".to_owned()));
    }
}
