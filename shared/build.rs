// `store::MIGRATOR` embeds `migrations/` at compile time (`sqlx::migrate!`), and every test
// database is built from it: build again whenever a migration is added or changed, so neither
// the functions nor the tests hold a stale schema.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
