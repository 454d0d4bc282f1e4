//! Build facts for `/version`: the profile, the target, the compiler and (when built from a
//! git checkout) the commit, "-dirty" when the Rust sources differ from it.

use std::process::Command;

fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok().filter(|o| o.status.success())?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    let profile = std::env::var("PROFILE").unwrap_or_default();
    let target = std::env::var("TARGET").unwrap_or_default();
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = output(&rustc, &["--version"]).unwrap_or_default();
    let mut commit = output("git", &["rev-parse", "--short=12", "HEAD"]).unwrap_or_default();
    // built from Rust sources that differ from that commit's
    let changed = ["status", "--porcelain", "--untracked-files=no", "--", "../../rust", "../../Cargo.toml"];
    if !commit.is_empty() && output("git", &changed).is_some() {
        commit.push_str("-dirty");
    }
    println!("cargo:rustc-env=LLMSERVE_BUILD_PROFILE={profile}");
    println!("cargo:rustc-env=LLMSERVE_BUILD_TARGET={target}");
    println!("cargo:rustc-env=LLMSERVE_BUILD_RUSTC={rustc_version}");
    println!("cargo:rustc-env=LLMSERVE_BUILD_COMMIT={commit}");
    // the commit moves with HEAD and the branch it names (a copy without .git has none), and
    // "-dirty" with the Rust sources
    for path in ["../../.git/HEAD", "../../.git/refs/heads", "../../.git/packed-refs", "../../rust", "../../Cargo.toml"]
    {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
