// The migrations are embedded at compile time (`sqlx::migrate!`, `#[sqlx::test(migrations)]`):
// build again whenever one is added or changed, so no build holds a stale schema.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
