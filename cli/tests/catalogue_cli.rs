//! The operator's tools speak the catalogue: `hookctl verify --scheme NAME` gives every
//! catalogue entry's known-answer vectors their recorded verdict (exit 0 valid, 1 invalid), and
//! `hookctl sign` signs as every entry whose signature a shared secret can make, so what it
//! prints verifies.

use std::path::Path;
use std::process::{Command, Output};

use shared::catalogue::{self, Kind, Part};

fn hookctl(args: &[String], secret: &str, dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hookctl"))
        .args(args)
        .env("HOOKCTL_SECRET", secret)
        .current_dir(dir)
        .output()
        .expect("run hookctl")
}

#[test]
fn verify_gives_every_vector_of_the_catalogue_its_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for (scheme, provider) in catalogue::providers() {
        for (i, vector) in provider.vectors.iter().enumerate() {
            let body = vector.body_bytes().unwrap();
            std::fs::write(dir.path().join("body"), &body).unwrap();
            let mut args: Vec<String> = ["verify", "--scheme", scheme.as_str(), "--body", "body"]
                .map(str::to_owned)
                .to_vec();
            for (name, value) in &vector.headers {
                args.extend(["-H".to_owned(), format!("{name}: {value}")]);
            }
            args.extend(["--at".to_owned(), vector.now.to_string()]);
            args.extend(["--method".to_owned(), vector.method.clone()]);
            if let Some(url) = &vector.url {
                args.extend(["--url".to_owned(), url.clone()]);
            }
            if let Some(layouts) = &vector.layouts {
                args.extend(["--layouts".to_owned(), layouts.join(",")]);
            }
            let out = hookctl(&args, &vector.secret, dir.path());
            let expected = if vector.valid { 0 } else { 1 };
            assert_eq!(
                out.status.code(),
                Some(expected),
                "{scheme} vector {i} ({}):\n{}{}",
                vector.source,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 100, "{checked} vectors");
}

#[test]
fn sign_signs_as_every_entry_a_shared_secret_can_sign() {
    let dir = tempfile::tempdir().unwrap();
    let body = r#"{"id":"evt_1","type":"thing.happened","event":{"type":"x"}}"#;
    std::fs::write(dir.path().join("body"), body).unwrap();
    let url = "https://hooks.example.com/webhooks/src?bodySHA256=".to_owned()
        + &hex::encode(<sha2::Sha256 as sha2::Digest>::digest(body.as_bytes()));
    let mut signed = 0;
    for (scheme, provider) in catalogue::providers() {
        let layout = &provider.signatures[0];
        let body_bound = layout.json.is_some()
            || layout.signed.iter().any(|p| matches!(p, Part::Json(_)))
            || layout.timestamp.as_ref().is_some_and(|t| t.json.is_some());
        if !matches!(layout.kind, Kind::Hmac | Kind::Digest) || body_bound {
            continue;
        }
        let secret = match layout.secret {
            catalogue::SecretEncoding::Whsec => "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            catalogue::SecretEncoding::Base64 => "c2lnbmluZy1zZWNyZXQ=",
            catalogue::SecretEncoding::Hex => "0123456789abcdef",
            _ => "signing-secret",
        };
        let at = "1700000000".to_owned();
        let sign: Vec<String> = [
            "sign",
            "--scheme",
            scheme.as_str(),
            "--body",
            "body",
            "--at",
            &at,
            "--url",
            &url,
        ]
        .map(str::to_owned)
        .to_vec();
        let out = hookctl(&sign, secret, dir.path());
        assert!(
            out.status.success(),
            "{scheme}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut verify: Vec<String> = [
            "verify",
            "--scheme",
            scheme.as_str(),
            "--body",
            "body",
            "--at",
            &at,
            "--url",
            &url,
        ]
        .map(str::to_owned)
        .to_vec();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            verify.extend(["-H".to_owned(), line.to_owned()]);
        }
        let checked = hookctl(&verify, secret, dir.path());
        assert_eq!(
            checked.status.code(),
            Some(0),
            "{scheme}: {}",
            String::from_utf8_lossy(&checked.stdout)
        );
        signed += 1;
    }
    assert!(signed >= 19, "{signed} entries signed");
}

/// A team tries a provider the catalogue lacks: `hookctl providers check` loads a draft entry
/// as the catalogue loads its files and runs its vectors, with no rebuild. A draft whose
/// vectors agree exits 0; one with a vector that disagrees exits 1 and names it; one that does
/// not load exits 2 with the field at fault.
#[test]
fn providers_check_validates_a_draft_entry_and_runs_its_vectors() {
    let entry = include_str!("../../shared/providers/razorpay.toml");
    let draft = Draft::new("razorpay", "acme");
    let write = |text: &str| draft.write(text);
    let check = || draft.check();

    write(entry);
    let out = check();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid, as recorded"));

    // The first vector's signature, one hex digit changed, still recorded as valid.
    let first_signature = entry
        .lines()
        .find(|l| l.starts_with("headers = "))
        .and_then(|l| l.split('"').nth(3))
        .unwrap()
        .to_owned();
    let mut wrong = first_signature.clone();
    wrong.replace_range(0..1, if wrong.starts_with('0') { "1" } else { "0" });
    write(&entry.replacen(&first_signature, &wrong, 1));
    let out = check();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("vector 0 (")
            && String::from_utf8_lossy(&out.stdout).contains("MISMATCH"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    write(&entry.replace("encoding = \"hex\"", "encoding = \"hexadecimal\""));
    let out = check();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("hexadecimal"));
}

/// A draft's handshake is checked with its signature: `providers check` answers each known
/// answer as ingest would and exits 1 naming the one whose recorded answer differs.
#[test]
fn providers_check_answers_a_drafts_handshake_known_answers() {
    let entry = include_str!("../../shared/providers/zoom.toml");
    let draft = Draft::new("zoom", "acme_zoom");
    let write = |text: &str| draft.write(text);
    let check = || draft.check();

    write(entry);
    let out = check();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("handshake vector 0 (") && stdout.contains("answered as recorded"),
        "{stdout}"
    );

    // The recorded encryptedToken, one hex digit changed.
    let token = "c37c6c4c0915b150208dea1135958fe6fe1b53e9231b3717c74d0fc5e17057d1";
    assert!(entry.contains(token));
    write(&entry.replace(token, &format!("d{}", &token[1..])));
    let out = check();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("handshake vector 0 (") && stdout.contains("MISMATCH"),
        "{stdout}"
    );
}

/// A draft entry in a directory of its own: an entry of the catalogue renamed, checked with
/// `hookctl providers check`.
struct Draft {
    dir: tempfile::TempDir,
    from: &'static str,
    name: &'static str,
}

impl Draft {
    fn new(from: &'static str, name: &'static str) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            from,
            name,
        }
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join(format!("{}.toml", self.name))
    }

    /// Writes `text`, an entry of `from`, as the draft named `name`.
    fn write(&self, text: &str) {
        let renamed = text.replace(
            &format!("name = \"{}\"", self.from),
            &format!("name = \"{}\"", self.name),
        );
        std::fs::write(self.path(), renamed).unwrap();
    }

    fn check(&self) -> std::process::Output {
        hookctl(
            &[
                "providers".into(),
                "check".into(),
                self.path().display().to_string(),
            ],
            "",
            self.dir.path(),
        )
    }
}
