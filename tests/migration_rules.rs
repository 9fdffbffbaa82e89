//! The rules every migration keeps, checked on the files themselves (no database):
//!
//! - a migration never changes once committed: sqlx records each applied migration's checksum,
//!   and a database that applied the first text refuses every later build (`VersionMismatch`);
//! - a migration after [`BASELINE`] never locks an existing table for long: an index on a table
//!   it did not create is built `CONCURRENTLY`, alone in a `-- no-transaction` file, and nothing
//!   rewrites or scans a table under a lock that stops writes (ALTER ... TYPE, a volatile
//!   default, VACUUM FULL, CLUSTER, a CHECK or foreign key added without NOT VALID...).
//!
//! `tests/migrate.rs` applies each such migration beside live writes; this catches the same
//! mistakes before anyone runs it, with the rule that was broken.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The newest migration written before these rules were checked. The ones up to it have
/// landed and are as they are; every later one keeps the rules.
const BASELINE: i64 = 20261201000034;

/// Migrations whose text changed after their first commit, each with the commit whose text is
/// authoritative. An entry is allowed only when no deployed database can hold the first text.
const EDITED_BEFORE_ANY_DEPLOY: &[(&str, &str)] = &[
    // 034 was added in af8de9c and its comment reworded in eb272ab, in the same submission:
    // nothing was deployed in between, so every database that applied 034 applied eb272ab's.
    (
        "20261201000034_events_room_to_complete.sql",
        "eb272aba88ebcb6652d1c33fabc7cf7bb0635fab",
    ),
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the repository")
        .to_path_buf()
}

fn migration_files() -> Vec<(i64, String)> {
    let mut files: Vec<(i64, String)> = std::fs::read_dir(repo_root().join("migrations"))
        .expect("migrations/ is readable")
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".sql"))
        .map(|name| {
            let version = name
                .split('_')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name}: a migration is named <version>_<what>.sql"));
            (version, name)
        })
        .collect();
    files.sort();
    files
}

fn git(args: &[&str]) -> Result<Vec<u8>, String> {
    let output = Command::new("git")
        .arg("-C")
        .arg(repo_root())
        .args(args)
        .output()
        .map_err(|e| format!("git {args:?} could not run: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "git {args:?}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(output.stdout)
}

fn git_text(args: &[&str]) -> String {
    String::from_utf8(git(args).unwrap()).unwrap()
}

/// The history this check reads: a full clone. Anything less fails with how to get one,
/// rather than passing on files it could not compare.
fn require_full_history() {
    let how = "this test compares every migration with its first committed version, so it needs \
               the repository's full git history: run it in a git clone (not an exported tree) \
               and, in CI, check out with full history (actions/checkout `fetch-depth: 0`, or \
               `git fetch --unshallow`)";
    match git(&["rev-parse", "--is-shallow-repository"]) {
        Err(e) => panic!("{how}: {e}"),
        Ok(out) if String::from_utf8_lossy(&out).trim() != "false" => {
            panic!("{how}: this checkout is shallow")
        }
        Ok(_) => {}
    }
}

/// The commit that first added `path`, when it is committed at all.
fn first_commit(path: &str) -> Option<String> {
    git_text(&["log", "--diff-filter=A", "--format=%H", "--", path])
        .lines()
        .last()
        .map(str::to_owned)
}

fn text_at(commit: &str, path: &str) -> Vec<u8> {
    git(&["show", &format!("{commit}:{path}")]).unwrap()
}

#[test]
fn no_migration_changed_after_its_first_commit() {
    require_full_history();
    let mut changed = Vec::new();
    let mut compared = 0;
    for (_, name) in migration_files() {
        let path = format!("migrations/{name}");
        let Some(first) = first_commit(&path) else {
            // Not committed yet: being written on this branch.
            continue;
        };
        compared += 1;
        let now = std::fs::read(repo_root().join(&path)).unwrap();
        let authoritative = EDITED_BEFORE_ANY_DEPLOY
            .iter()
            .find(|(file, _)| *file == name)
            .map(|(_, commit)| *commit);
        match authoritative {
            None if text_at(&first, &path) != now => {
                changed.push(format!("{name} differs from its first commit {first}"));
            }
            None => {}
            Some(commit) => {
                assert!(
                    text_at(&first, &path) != now,
                    "{name} is listed in EDITED_BEFORE_ANY_DEPLOY but matches its first commit \
                     {first}: remove the entry"
                );
                if text_at(commit, &path) != now {
                    changed.push(format!(
                        "{name} differs from {commit}, the text EDITED_BEFORE_ANY_DEPLOY holds \
                         authoritative"
                    ));
                }
            }
        }
    }
    for (file, _) in EDITED_BEFORE_ANY_DEPLOY {
        assert!(
            migration_files().iter().any(|(_, name)| name == file),
            "EDITED_BEFORE_ANY_DEPLOY names {file}, which is not in migrations/"
        );
    }
    assert!(compared > 0, "no committed migration was compared");
    assert!(
        changed.is_empty(),
        "a committed migration was edited, so every database that applied it now refuses to \
         migrate (VersionMismatch); put the file back as it was and write the change as a new \
         migration:\n{}",
        changed.join("\n")
    );
}

#[test]
fn no_committed_migration_was_deleted() {
    require_full_history();
    let present: Vec<String> = migration_files().into_iter().map(|(_, n)| n).collect();
    let deleted: Vec<String> = git_text(&[
        "log",
        "--diff-filter=D",
        "--format=",
        "--name-only",
        "--",
        "migrations/",
    ])
    .lines()
    .filter_map(|l| l.strip_prefix("migrations/"))
    .filter(|n| n.ends_with(".sql") && !present.iter().any(|p| p == n))
    .map(str::to_owned)
    .collect();
    assert!(
        deleted.is_empty(),
        "migrations deleted after they were committed (a database that applied them answers \
         VersionMissing to a build without them only if it ignores missing ones; restore \
         them): {deleted:?}"
    );
}

/// A migration's statements, lower-cased, comments dropped, literals and dollar-quoted bodies
/// blanked (so a function body's text is not read as statements).
fn statements(sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let chars: Vec<char> = sql.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '-' && next == Some('-') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            current.push(' ');
            continue;
        }
        if c == '/' && next == Some('*') {
            i += 2;
            while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                i += 1;
            }
            i += 2;
            current.push(' ');
            continue;
        }
        if c == '\'' {
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
            current.push_str(" 'literal' ");
            continue;
        }
        if c == '$' {
            // $tag$ ... $tag$
            let tag_end = chars[i + 1..]
                .iter()
                .position(|c| !(c.is_alphanumeric() || *c == '_'))
                .map(|p| i + 1 + p);
            if let Some(end) = tag_end.filter(|&e| chars[e] == '$') {
                let tag: String = chars[i..=end].iter().collect();
                let rest: String = chars[end + 1..].iter().collect();
                let body_len = rest.find(&tag).unwrap_or(rest.len());
                i = end + 1 + rest[..body_len].chars().count() + tag.chars().count();
                current.push_str(" 'body' ");
                continue;
            }
        }
        if c == ';' {
            out.push(std::mem::take(&mut current));
        } else if c == '(' || c == ')' || c == ',' {
            current.push(' ');
            current.push(c);
            current.push(' ');
        } else {
            current.extend(c.to_lowercase());
        }
        i += 1;
    }
    out.push(current);
    out.into_iter()
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty())
        .collect()
}

/// The table a `CREATE [UNIQUE] INDEX [CONCURRENTLY] [IF NOT EXISTS] [name] ON [ONLY] t`
/// statement indexes, and whether it is built concurrently.
fn index_target(statement: &str) -> Option<(String, bool)> {
    let words: Vec<&str> = statement.split(' ').collect();
    let create = words.first() == Some(&"create");
    let index_at = words.iter().position(|w| *w == "index")?;
    if !create || !words[1..index_at].iter().all(|w| *w == "unique") {
        return None;
    }
    let concurrently = words.get(index_at + 1) == Some(&"concurrently");
    let on = words.iter().position(|w| *w == "on")?;
    let table = words[on + 1..].iter().find(|w| **w != "only")?;
    Some((table.trim_matches('"').to_owned(), concurrently))
}

/// The tables and materialized views a migration creates: an index on one of them locks only a
/// relation no other session can see before the migration commits.
fn created_tables(statements: &[String]) -> Vec<String> {
    statements
        .iter()
        .filter_map(|s| {
            let rest = s
                .strip_prefix("create table ")
                .or_else(|| s.strip_prefix("create materialized view "))?;
            let rest = rest.strip_prefix("if not exists ").unwrap_or(rest);
            rest.split(' ')
                .next()
                .map(|t| t.trim_matches('"').to_owned())
        })
        .collect()
}

/// What the rules say about one migration: every rule it breaks.
fn broken_rules(sql: &str) -> Vec<String> {
    let no_transaction = sql.starts_with("-- no-transaction");
    let statements = statements(sql);
    let created = created_tables(&statements);
    let mut broken = Vec::new();
    let concurrent = statements.iter().any(|s| s.contains(" concurrently "));
    if concurrent && !no_transaction {
        broken.push(
            "a CONCURRENTLY statement cannot run in a transaction: the file's first line must \
             be `-- no-transaction`"
                .to_owned(),
        );
    }
    if no_transaction && statements.len() != 1 {
        broken.push(format!(
            "a `-- no-transaction` file holds exactly one statement ({} here): PostgreSQL runs \
             several sent at once in one implicit transaction, where CONCURRENTLY fails, and a \
             failure halfway leaves the first ones applied but unrecorded",
            statements.len()
        ));
    }
    for s in &statements {
        let has = |words: &str| s.contains(words);
        if let Some((table, concurrently)) = index_target(s)
            && !created.contains(&table)
            && !concurrently
        {
            broken.push(format!(
                "an index on the existing table {table} is built without CONCURRENTLY, under a \
                 SHARE lock that stops every write until it is built: `{s}`"
            ));
        }
        if s.starts_with("reindex") && !has(" concurrently ") {
            broken.push(format!("REINDEX without CONCURRENTLY stops writes: `{s}`"));
        }
        if s.starts_with("alter table") {
            // ALTER [COLUMN] name TYPE ... (SET DATA TYPE is caught below).
            let alter_type = s.split(" alter ").skip(1).any(|clause| {
                let mut words = clause.split(' ');
                let mut name = words.next();
                if name == Some("column") {
                    name = words.next();
                }
                name.is_some() && words.next() == Some("type")
            });
            if has(" set data type ") || alter_type {
                broken.push(format!(
                    "changing a column's type rewrites the table under ACCESS EXCLUSIVE: `{s}`"
                ));
            }
            for clause in s.split(" add ").skip(1) {
                let clause = clause.split(" , add ").next().unwrap_or_default();
                let volatile = [
                    "random (",
                    "gen_random_uuid (",
                    "uuid_generate_v",
                    "clock_timestamp (",
                    "timeofday (",
                    "nextval (",
                    " serial",
                    " bigserial",
                    " smallserial",
                    " generated always as identity",
                    " generated by default as identity",
                    " stored",
                ];
                if clause.starts_with("column")
                    && let Some(v) = volatile.iter().find(|v| clause.contains(**v))
                {
                    broken.push(format!(
                        "a new column whose default is computed per row ({}) rewrites the \
                         table under ACCESS EXCLUSIVE: `{s}`",
                        v.trim()
                    ));
                }
                let checked = clause.contains(" check (")
                    || clause.contains(" foreign key ")
                    || clause.contains(" references ");
                if checked && !clause.contains(" not valid") {
                    broken.push(format!(
                        "a CHECK or foreign key added without NOT VALID scans the table under a \
                         lock that stops writes: add it NOT VALID and VALIDATE it in a later \
                         migration: `{s}`"
                    ));
                }
                let indexed = clause.contains(" unique ") || clause.contains(" primary key ");
                if clause.starts_with("constraint") && indexed && !clause.contains(" using index ")
                {
                    broken.push(format!(
                        "a UNIQUE or PRIMARY KEY constraint builds its index under ACCESS \
                         EXCLUSIVE: build the index CONCURRENTLY first and add the constraint \
                         USING INDEX: `{s}`"
                    ));
                }
            }
            if has(" set logged") || has(" set unlogged") || has(" set tablespace ") {
                broken.push(format!("this rewrites the table: `{s}`"));
            }
        }
        if s.starts_with("vacuum") && has(" full") {
            broken.push(format!(
                "VACUUM FULL rewrites the table under ACCESS EXCLUSIVE: `{s}`"
            ));
        }
        if s.starts_with("cluster") {
            broken.push(format!(
                "CLUSTER rewrites the table under ACCESS EXCLUSIVE: `{s}`"
            ));
        }
    }
    broken
}

#[test]
fn every_migration_after_the_baseline_locks_no_table_for_long() {
    let mut broken = Vec::new();
    for (version, name) in migration_files() {
        if version <= BASELINE {
            continue;
        }
        let sql = std::fs::read_to_string(repo_root().join("migrations").join(&name)).unwrap();
        for rule in broken_rules(&sql) {
            broken.push(format!("{name}: {rule}"));
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The checker itself, on migrations that break each rule and on ones that keep them all.
#[test]
fn the_rules_tell_a_long_lock_from_a_short_one() {
    let bad = [
        "CREATE INDEX webhook_events_by_type ON webhook_events (event_type);",
        "create unique index if not exists x on only public_t (a)",
        "-- no-transaction\nCREATE INDEX CONCURRENTLY a ON webhook_events (x);\nCREATE INDEX CONCURRENTLY b ON webhook_events (y);",
        "CREATE INDEX CONCURRENTLY a ON webhook_events (x);",
        "ALTER TABLE webhook_events ALTER COLUMN attempts TYPE bigint;",
        "ALTER TABLE webhook_events ALTER attempts SET DATA TYPE bigint;",
        "ALTER TABLE webhook_events ADD COLUMN token uuid NOT NULL DEFAULT gen_random_uuid();",
        "ALTER TABLE outbox ADD COLUMN n bigserial;",
        "ALTER TABLE outbox ADD CONSTRAINT outbox_n CHECK (n > 0);",
        "ALTER TABLE outbox ADD CONSTRAINT outbox_fk FOREIGN KEY (a) REFERENCES b (a);",
        "ALTER TABLE outbox ADD COLUMN b text REFERENCES other (b);",
        "ALTER TABLE outbox ADD CONSTRAINT outbox_u UNIQUE (a);",
        "VACUUM FULL webhook_events;",
        "CLUSTER webhook_events USING webhook_events_pkey;",
        "REINDEX TABLE webhook_events;",
        "CREATE MATERIALIZED VIEW w AS SELECT 1 AS key;\nCREATE UNIQUE INDEX v_key ON v (key);",
    ];
    for sql in bad {
        assert!(!broken_rules(sql).is_empty(), "passed: {sql}");
    }
    let good = [
        "-- no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_events_by_type ON webhook_events (event_type);",
        "-- no-transaction\n-- Why: ...\nCREATE UNIQUE INDEX CONCURRENTLY u ON outbox (a) WHERE status = 'pending';",
        "CREATE TABLE t (a text PRIMARY KEY, b text CHECK (b <> ''));\nCREATE INDEX t_b ON t (b);",
        "DROP MATERIALIZED VIEW v;\nCREATE MATERIALIZED VIEW v AS SELECT 1 AS key;\nCREATE UNIQUE INDEX v_key ON v (key);",
        "ALTER TABLE webhook_events ADD COLUMN note text;",
        "ALTER TABLE webhook_events ADD COLUMN seen timestamptz NOT NULL DEFAULT now();",
        "ALTER TABLE outbox ADD CONSTRAINT outbox_n CHECK (n > 0) NOT VALID;",
        "ALTER TABLE outbox VALIDATE CONSTRAINT outbox_n;",
        "ALTER TABLE outbox ADD CONSTRAINT outbox_u UNIQUE USING INDEX u;",
        "ALTER TABLE webhook_events SET (fillfactor = 50);",
        "ALTER TABLE webhook_events ALTER COLUMN type SET DEFAULT 'x';",
        "CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$ CREATE INDEX i ON webhook_events (x); ALTER TABLE a ALTER COLUMN b TYPE int; $$;",
        "COMMENT ON COLUMN outbox.a IS 'CLUSTER; VACUUM FULL';",
    ];
    for sql in good {
        assert_eq!(broken_rules(sql), Vec::<String>::new(), "{sql}");
    }
}
