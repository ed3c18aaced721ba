//! No C++ exception can cross `extern "C"`: every exported function of the bridge is
//! `noexcept` (and catches inside), or runs its body in `MS_TRY`, which catches
//! everything and reports through the status code. Code before `MS_TRY` may only
//! declare variables or run inside its own `try` block.
use std::fs;
use std::path::Path;

/// (file, function signature, body) of every function defined in an `extern "C"` block.
fn exported_functions() -> Vec<(String, String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cpp");
    let mut out = Vec::new();
    for entry in fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("cpp") {
            continue;
        }
        let text = fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut rest = text.as_str();
        while let Some(start) = rest.find("extern \"C\" {") {
            let block = &rest[start + "extern \"C\" {".len()..];
            let end = block
                .find("}  // extern \"C\"")
                .expect("extern \"C\" blocks end with `}  // extern \"C\"`");
            collect(&name, &block[..end], &mut out);
            rest = &block[end..];
        }
        // One-line `extern "C" T f(...) {` definitions.
        for (i, _) in text.match_indices("extern \"C\" ") {
            let line = text[i..].lines().next().unwrap();
            if !line.contains("extern \"C\" {") && line.trim_end().ends_with('{') {
                collect(&name, &text[i + "extern \"C\" ".len()..], &mut out);
            }
        }
    }
    out
}

/// Splits top-level function definitions out of `block`.
fn collect(file: &str, block: &str, out: &mut Vec<(String, String, String)>) {
    let bytes = block.as_bytes();
    let mut i = 0;
    let mut signature_start = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                signature_start = i;
            }
            b';' => signature_start = i + 1,
            b'{' => {
                let body_start = i;
                i = closing_brace(block, i);
                let signature = block[signature_start..body_start].trim().to_owned();
                if signature.contains('(') {
                    out.push((file.to_owned(), signature, block[body_start..=i].to_owned()));
                }
                signature_start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
}

/// The index of the `}` that closes the `{` at `open` (the last index if none does).
fn closing_brace(text: &str, open: usize) -> usize {
    let mut depth = 0usize;
    for (i, b) in text.bytes().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    text.len() - 1
}

/// True when everything before `MS_TRY(` is declarations or self-contained try blocks.
fn guarded(body: &str) -> bool {
    let Some(at) = body.find("MS_TRY(") else {
        return false;
    };
    let prelude = body[1..at].trim();
    let mut rest = prelude;
    while !rest.is_empty() {
        if rest.starts_with("try {") {
            // Skip the try block and its catch clauses.
            rest = rest[closing_brace(rest, "try ".len()) + 1..].trim_start();
            while rest.starts_with("catch") {
                let open = rest.find('{').unwrap();
                rest = rest[closing_brace(rest, open) + 1..].trim_start();
            }
            continue;
        }
        let (statement, tail) = rest.split_once(';').unwrap_or((rest, ""));
        // A declaration: `Type name` or `Type<...> name`, no call, no assignment.
        let is_declaration = !statement.contains('(')
            && !statement.contains('=')
            && statement.split_whitespace().count() == 2;
        if !is_declaration {
            return false;
        }
        rest = tail.trim_start();
    }
    true
}

#[test]
fn no_exported_function_can_let_an_exception_escape() {
    let functions = exported_functions();
    assert!(
        functions.len() > 40,
        "found only {} exported functions",
        functions.len()
    );
    let unguarded: Vec<String> = functions
        .iter()
        .filter(|(_, signature, body)| !signature.contains("noexcept") && !guarded(body))
        .map(|(file, signature, _)| format!("{file}: {signature}"))
        .collect();
    assert!(
        unguarded.is_empty(),
        "exported functions that can throw:\n{}",
        unguarded.join("\n")
    );
}

#[test]
fn the_guard_check_rejects_unguarded_bodies() {
    assert!(!guarded("{ return at::foo(); }"));
    assert!(!guarded(
        "{ auto p = std::make_unique<X>(); MS_TRY({ f(); }) }"
    ));
    assert!(guarded("{ MS_TRY({ f(); }) }"));
    assert!(guarded("{ std::unique_ptr<X> p; try { p = g(); } catch (...) { h(); return 1; } MS_TRY({ f(); }) }"));
}
