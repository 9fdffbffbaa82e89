//! The documentation as a reader follows it: every `hookctl` command in README.md and docs/*.md
//! is a real command of the binary (its subcommands exist, its flags exist and its values
//! parse), every `./scripts/...` it names is there to run, and every relative link between the
//! pages lands on a file and a heading that exist.
//!
//! Commands come from shell code blocks (```bash, ```sh, ```shell, ```console) and from inline
//! code: a span that starts with `hookctl` (or `target/debug/hookctl`, after any `VAR=value`), or
//! with a subcommand and more (the operator's command table: `runs list [--job reconcile]`,
//! `dead-letters list\|show`, expanded into one command per alternative). Placeholders are
//! filled in: `<id>` and the like become `1`, an optional `[--at 1764496800]` is given.
//!
//! Each command runs as `hookctl <argv> --help`: clap reads the argv in order, so a subcommand or
//! flag that does not exist, or a value that does not parse, fails before `--help` prints
//! anything; `--help` then stops it before it touches a database or an AWS account.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// README.md and every page under docs/, as (path relative to the root, text).
fn pages() -> Vec<(String, String)> {
    let root = root();
    let mut names = vec!["README.md".to_owned()];
    let mut docs: Vec<String> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    names.extend(docs);
    names
        .into_iter()
        .map(|n| {
            let text = std::fs::read_to_string(root.join(&n)).unwrap();
            (n, text)
        })
        .collect()
}

/// One fenced code block: its info string, and its lines with their 1-based line numbers.
struct Fence {
    lang: String,
    lines: Vec<(usize, String)>,
}

/// The page split into fenced blocks, and its prose with every fenced line blanked (so offsets
/// still give line numbers).
fn split_fences(text: &str) -> (Vec<Fence>, String) {
    let mut fences = Vec::new();
    let mut prose = String::new();
    let mut open: Option<Fence> = None;
    for (i, line) in text.lines().enumerate() {
        let fence_line = line.trim_start().starts_with("```");
        match (&mut open, fence_line) {
            (None, true) => {
                open = Some(Fence {
                    lang: line.trim_start().trim_start_matches('`').trim().to_owned(),
                    lines: Vec::new(),
                });
            }
            (Some(_), true) => fences.push(open.take().unwrap()),
            (Some(f), false) => f.lines.push((i + 1, line.to_owned())),
            (None, false) => prose.push_str(line),
        }
        prose.push('\n');
    }
    (fences, prose)
}

/// Inline code spans of the prose: (line of the opening backtick, content with line breaks as
/// spaces). A span never crosses a blank line.
fn inline_spans(prose: &str) -> Vec<(usize, String)> {
    let mut spans = Vec::new();
    let mut rest = prose;
    let mut offset = 0;
    while let Some(start) = rest.find('`') {
        let after = &rest[start + 1..];
        let Some(len) = after.find('`') else { break };
        let content = &after[..len];
        if content.contains("\n\n") || content.is_empty() {
            offset += start + 1;
            rest = after;
            continue;
        }
        let line = prose[..offset + start].matches('\n').count() + 1;
        spans.push((line, content.replace('\n', " ")));
        offset += start + 1 + len + 1;
        rest = &after[len + 1..];
    }
    spans
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Word {
        text: String,
        quoted: bool,
    },
    /// `|`, `>`, `<`, `;`, `&`, or a `#` comment: the simple command ends here.
    End,
}

/// Splits a shell line into words as sh would (quotes, backslashes), marking where a simple
/// command ends.
fn shell_words(line: &str) -> Vec<Token> {
    fn flush(word: &mut String, in_word: &mut bool, quoted: &mut bool, tokens: &mut Vec<Token>) {
        if *in_word {
            tokens.push(Token::Word {
                text: std::mem::take(word),
                quoted: *quoted,
            });
        }
        *in_word = false;
        *quoted = false;
    }
    let mut tokens = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => flush(&mut word, &mut in_word, &mut quoted, &mut tokens),
            '\'' => {
                in_word = true;
                quoted = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    word.push(c);
                }
            }
            '"' => {
                in_word = true;
                quoted = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' if matches!(chars.peek(), Some('"' | '\\' | '$' | '`')) => {
                            word.push(chars.next().unwrap());
                        }
                        c => word.push(c),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(c) = chars.next() {
                    word.push(c);
                }
            }
            '#' if !in_word => {
                tokens.push(Token::End);
                return tokens;
            }
            '|' | '>' | '<' | ';' | '&' => {
                flush(&mut word, &mut in_word, &mut quoted, &mut tokens);
                tokens.push(Token::End);
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    flush(&mut word, &mut in_word, &mut quoted, &mut tokens);
    tokens
}

fn is_assignment(text: &str) -> bool {
    text.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    })
}

fn is_hookctl(text: &str) -> bool {
    text == "hookctl" || text.ends_with("/hookctl")
}

/// The argv after `hookctl` of every simple command of the line that runs it (after any
/// `VAR=value` assignments), placeholders filled in.
fn hookctl_argvs(line: &str) -> Vec<Vec<String>> {
    let line = fill_placeholders(line);
    let mut argvs = Vec::new();
    let mut at_command = true;
    let mut current: Option<Vec<(String, bool)>> = None;
    for token in shell_words(&line) {
        match token {
            Token::End => {
                argvs.extend(current.take());
                at_command = true;
            }
            Token::Word { text, quoted } => {
                if let Some(argv) = &mut current {
                    argv.push((text, quoted));
                } else if at_command && !quoted && is_hookctl(&text) {
                    current = Some(Vec::new());
                } else if !(at_command && !quoted && is_assignment(&text)) {
                    at_command = false;
                }
            }
        }
    }
    argvs.extend(current);
    argvs.into_iter().map(drop_optional_brackets).collect()
}

/// `<anything>` becomes `1` (a number parses as any value these commands take), before the line
/// is split into words: sh would read `<stack>-operator` as a redirection.
fn fill_placeholders(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find('<') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        match after.find('>') {
            Some(len)
                if after.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && !after[..len].contains('<') =>
            {
                out.push('1');
                rest = &after[len + 1..];
            }
            _ => {
                out.push('<');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// An optional group `[--flag value]` is given without its brackets.
fn drop_optional_brackets(argv: Vec<(String, bool)>) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_group = false;
    for (mut word, quoted) in argv {
        if !quoted {
            if word.starts_with("[-") {
                word.remove(0);
                in_group = true;
            }
            if in_group && word.ends_with(']') {
                word.pop();
                in_group = false;
            }
        }
        out.push(word);
    }
    out
}

/// `a\|b\|c` (a table cell's alternatives) as one text per alternative.
fn alternatives(span: &str) -> Vec<String> {
    let mut texts = vec![String::new()];
    for (i, word) in span.split(' ').enumerate() {
        let options: Vec<&str> = word.split("\\|").collect();
        texts = texts
            .iter()
            .flat_map(|t| {
                options.iter().map(move |o| {
                    if i == 0 {
                        (*o).to_owned()
                    } else {
                        format!("{t} {o}")
                    }
                })
            })
            .collect();
    }
    texts
}

/// A documented command: where it is written, as written, and the argv it stands for.
struct Documented {
    page: String,
    line: usize,
    written: String,
    argv: Vec<String>,
}

fn documented_commands(subcommands: &BTreeSet<String>) -> Vec<Documented> {
    let mut found = Vec::new();
    for (page, text) in pages() {
        let (fences, prose) = split_fences(&text);
        for fence in fences {
            let console = fence.lang == "console";
            if !matches!(fence.lang.as_str(), "bash" | "sh" | "shell" | "console") {
                continue;
            }
            // Logical lines: a trailing backslash continues the line.
            let mut logical: Vec<(usize, String)> = Vec::new();
            let mut continues = false;
            for (n, line) in fence.lines {
                let line = if console {
                    match line.strip_prefix("$ ") {
                        Some(command) => command.to_owned(),
                        None if continues => line,
                        None => continue,
                    }
                } else {
                    line
                };
                let (body, next_continues) = match line.trim_end().strip_suffix('\\') {
                    Some(body) => (body.to_owned(), true),
                    None => (line, false),
                };
                if continues {
                    let last = logical.last_mut().unwrap();
                    last.1.push(' ');
                    last.1.push_str(&body);
                } else {
                    logical.push((n, body));
                }
                continues = next_continues;
            }
            for (n, line) in logical {
                for argv in hookctl_argvs(&line) {
                    found.push(Documented {
                        page: page.clone(),
                        line: n,
                        written: line.trim().to_owned(),
                        argv,
                    });
                }
            }
        }
        for (n, span) in inline_spans(&prose) {
            let span = span.trim();
            let first = span.split(' ').next().unwrap_or_default();
            let words = span.split(' ').count();
            let texts = if shell_words(span)
                .iter()
                .any(|t| matches!(t, Token::Word { text, quoted: false } if is_hookctl(text)))
            {
                vec![span.to_owned()]
            } else if words > 1 && subcommands.contains(first) {
                alternatives(span)
                    .into_iter()
                    .map(|t| format!("hookctl {t}"))
                    .collect()
            } else {
                continue;
            };
            for text in texts {
                for argv in hookctl_argvs(&text) {
                    found.push(Documented {
                        page: page.clone(),
                        line: n,
                        written: span.to_owned(),
                        argv,
                    });
                }
            }
        }
    }
    found
}

fn hookctl() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hookctl"));
    for var in [
        "HOOKCTL_FUNCTION",
        "HOOKCTL_LAMBDA_ENDPOINT",
        "HOOKCTL_SECRET",
        "HOOKCTL_PREVIOUS_SECRET",
        "DATABASE_URL",
    ] {
        command.env_remove(var);
    }
    command
}

/// The binary's own top-level subcommands, read from its help.
fn subcommands() -> BTreeSet<String> {
    let out = hookctl().arg("--help").output().expect("run hookctl");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let commands = help
        .split("Commands:\n")
        .nth(1)
        .expect("hookctl --help lists its commands");
    commands
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_documented_hookctl_command_is_a_real_command_with_real_flags() {
    let subcommands = subcommands();
    assert!(
        subcommands.contains("status") && subcommands.contains("dead-letters"),
        "hookctl's commands as read from its help: {subcommands:?}"
    );
    let documented = documented_commands(&subcommands);
    let mut failures = Vec::new();
    let mut seen_pages = BTreeSet::new();
    for doc in &documented {
        seen_pages.insert(doc.page.as_str());
        let out = hookctl()
            .args(&doc.argv)
            .arg("--help")
            .output()
            .expect("run hookctl");
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why: Vec<&str> = stderr
                .lines()
                .filter(|l| !l.trim().is_empty())
                .take(3)
                .collect();
            failures.push(format!(
                "{}:{}: `{}` (argv {:?}) is not a hookctl command: {}",
                doc.page,
                doc.line,
                doc.written,
                doc.argv,
                why.join(" / ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} documented command(s) do not parse:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The extraction itself must keep finding the commands the pages show.
    assert!(
        documented.len() >= 30,
        "only {} hookctl commands found in the documentation",
        documented.len()
    );
    for page in ["docs/operating.md", "docs/configuration.md"] {
        assert!(
            seen_pages.contains(page),
            "no hookctl command found in {page}"
        );
    }
    for (argv, page) in [
        (&["outbox", "resend"][..], "docs/operating.md"),
        (&["status"][..], "docs/operating.md"),
        (&["drill", "--short"][..], "docs/operating.md"),
        (&["sources", "apply"][..], "docs/configuration.md"),
    ] {
        assert!(
            documented.iter().any(|d| d.page == page
                && d.argv.len() >= argv.len()
                && d.argv.iter().zip(argv).all(|(a, b)| a == b)),
            "`hookctl {}` not found in {page}",
            argv.join(" ")
        );
    }
}

#[test]
fn the_extraction_reads_commands_as_a_shell_would() {
    assert_eq!(
        hookctl_argvs(
            "HOOKCTL_SECRET=whsec_... target/debug/hookctl verify --scheme stripe --body b.json [--at 1764496800]   # old capture"
        ),
        vec![vec![
            "verify",
            "--scheme",
            "stripe",
            "--body",
            "b.json",
            "--at",
            "1764496800"
        ]]
    );
    assert_eq!(
        hookctl_argvs(
            r#"target/debug/hookctl operator '{"action":"replay","filter":{"ids":[7,8]}}' > out.json"#
        ),
        vec![vec![
            "operator",
            r#"{"action":"replay","filter":{"ids":[7,8]}}"#
        ]]
    );
    assert_eq!(
        hookctl_argvs("hookctl --function <stack>-operator dead-letters show <id>"),
        vec![vec![
            "--function",
            "1-operator",
            "dead-letters",
            "show",
            "1"
        ]]
    );
    assert!(hookctl_argvs("curl -sS http://127.0.0.1:8080/operator -d '{}'").is_empty());
    assert!(hookctl_argvs("echo hookctl status").is_empty());
    assert_eq!(
        alternatives(r"tombstones add\|list"),
        vec!["tombstones add", "tombstones list"]
    );
}

#[test]
fn every_script_the_documentation_names_exists_and_is_executable() {
    let root = root();
    let mut failures = Vec::new();
    let mut named = 0;
    for (page, text) in pages() {
        for (i, line) in text.lines().enumerate() {
            for (at, _) in line.match_indices("./scripts/") {
                let path: String = line[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || "-_./".contains(*c))
                    .collect();
                let path = path.trim_end_matches('.');
                if path.ends_with('/') {
                    continue; // `./scripts/...`: the folder, not a script
                }
                named += 1;
                let executable = std::fs::metadata(root.join(path))
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
                if !executable {
                    failures.push(format!(
                        "{page}:{}: `{path}` is not an executable file",
                        i + 1
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        named >= 3,
        "only {named} scripts named in the documentation"
    );
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens; a repeated
/// heading gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let (_, prose) = split_fences(text);
    let mut anchors = BTreeSet::new();
    for line in prose.lines() {
        let level = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&level) || !line[level..].starts_with(' ') {
            continue;
        }
        let slug: String = line[level..]
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut candidate = slug.clone();
        let mut n = 0;
        while anchors.contains(&candidate) {
            n += 1;
            candidate = format!("{slug}-{n}");
        }
        anchors.insert(candidate);
    }
    anchors
}

#[test]
fn every_relative_link_lands_on_a_page_and_a_heading_that_exist() {
    let root = root();
    let mut failures = Vec::new();
    let mut links = 0;
    for (page, text) in pages() {
        let (_, prose) = split_fences(&text);
        // Links inside inline code are not links.
        let mut outside_code = String::with_capacity(prose.len());
        for (i, part) in prose.split('`').enumerate() {
            if i % 2 == 0 {
                outside_code.push_str(part);
            } else {
                outside_code.extend(part.chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
            }
            outside_code.push(' ');
        }
        for (at, _) in outside_code.match_indices("](") {
            let target: String = outside_code[at + 2..]
                .chars()
                .take_while(|c| *c != ')' && !c.is_whitespace())
                .collect();
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            links += 1;
            let line = outside_code[..at].matches('\n').count() + 1;
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let page_dir = Path::new(&page).parent().unwrap();
            let resolved = if file.is_empty() {
                root.join(&page)
            } else {
                root.join(page_dir).join(file)
            };
            // A picture (the console's screenshots) is a file, not text.
            let Ok(bytes) = std::fs::read(&resolved) else {
                failures.push(format!("{page}:{line}: ({target}): no file {file}"));
                continue;
            };
            let linked = String::from_utf8_lossy(&bytes);
            if let Some(anchor) = anchor
                && resolved.extension().is_some_and(|e| e == "md")
                && !anchors(&linked).contains(anchor)
            {
                failures.push(format!(
                    "{page}:{line}: ({target}): {} has no heading #{anchor}",
                    if file.is_empty() { &page } else { file }
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(links >= 10, "only {links} relative links found");
}
