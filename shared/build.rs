// `store::MIGRATOR` embeds `migrations/` at compile time (`sqlx::migrate!`), and every test
// database is built from it: build again whenever a migration is added or changed, so neither
// the functions nor the tests hold a stale schema.
//
// The provider catalogue (`providers/*.toml`) is compiled in the same way: this script lists
// the files, and `catalogue` parses and validates them (its tests refuse a catalogue that does
// not load). Adding a provider is adding a file; no Rust changes.
use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=../migrations");
    println!("cargo:rerun-if-changed=providers");

    let dir =
        Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("providers");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("shared/providers/ holds the provider catalogue")
        .filter_map(|entry| {
            let path = entry.expect("readable directory").path();
            (path.extension().is_some_and(|e| e == "toml")).then(|| {
                path.file_stem()
                    .expect("a file name")
                    .to_string_lossy()
                    .into_owned()
            })
        })
        .collect();
    names.sort();
    for name in &names {
        assert!(
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "providers/{name}.toml: a provider's file name is its scheme name, [a-z0-9_]+"
        );
    }

    let mut out = String::new();
    writeln!(
        out,
        "/// Every catalogue file, `(scheme name, TOML text)`, sorted by name."
    )
    .unwrap();
    writeln!(
        out,
        "pub(crate) const FILES: [(&str, &str); {}] = [",
        names.len()
    )
    .unwrap();
    for name in &names {
        let path = dir.join(format!("{name}.toml"));
        writeln!(
            out,
            "    ({name:?}, include_str!({:?})),",
            path.display().to_string()
        )
        .unwrap();
    }
    writeln!(out, "];").unwrap();
    let target =
        Path::new(&std::env::var("OUT_DIR").expect("cargo sets it")).join("catalogue_files.rs");
    std::fs::write(target, out).expect("OUT_DIR is writable");

    // The scheme names and their constants, for `domain`: a Scheme is an index into FILES, in
    // the same order, and `domain` needs no more of the catalogue than its names.
    let mut out = String::new();
    writeln!(
        out,
        "/// Every catalogue entry's scheme name, in the order of `catalogue::FILES`."
    )
    .unwrap();
    writeln!(out, "pub(crate) const NAMES: [&str; {}] = [", names.len()).unwrap();
    for name in &names {
        writeln!(out, "    {name:?},").unwrap();
    }
    writeln!(out, "];").unwrap();
    writeln!(out, "#[allow(non_upper_case_globals)]").unwrap();
    writeln!(out, "impl crate::domain::Scheme {{").unwrap();
    for (i, name) in names.iter().enumerate() {
        writeln!(out, "    /// The `{name}` entry of the provider catalogue.").unwrap();
        writeln!(out, "    pub const {}: Self = Self({i});", camel(name)).unwrap();
    }
    writeln!(
        out,
        "    /// A provider not in the catalogue: the source declares its signature."
    )
    .unwrap();
    writeln!(out, "    pub const Declared: Self = Self({});", names.len()).unwrap();
    writeln!(
        out,
        "    /// Every provider in the catalogue, in name order."
    )
    .unwrap();
    writeln!(out, "    pub const ALL: [Self; {}] = [", names.len()).unwrap();
    for name in &names {
        writeln!(out, "        Self::{},", camel(name)).unwrap();
    }
    writeln!(out, "    ];").unwrap();
    writeln!(out, "}}").unwrap();
    let target =
        Path::new(&std::env::var("OUT_DIR").expect("cargo sets it")).join("scheme_names.rs");
    std::fs::write(target, out).expect("OUT_DIR is writable");
}
/// `standard_webhooks` -> `StandardWebhooks`.
fn camel(name: &str) -> String {
    name.split('_')
        .map(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect()
}
