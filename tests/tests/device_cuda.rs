//! `--device cuda` on a machine without CUDA (or in a build without the `cuda` feature) stops
//! with one clear error, never a panic; where a GPU is usable, the same commands succeed.

use orchestrator_e2e::{run, stderr};

fn clear_cuda_error_or_success(name: &str, args: &[&str]) {
    let out = run(name, args);
    let err = stderr(&out);
    assert!(!err.contains("panicked"), "{name} {args:?} panicked:\n{err}");
    if out.status.success() {
        return; // a usable GPU in a cuda build
    }
    assert!(
        err.contains("built without the `cuda` feature") || err.contains("CUDA is not usable on this machine: cannot load"),
        "{name} {args:?}: unclear error:\n{err}"
    );
}

#[test]
fn worker_load_on_cuda_is_a_clear_error_without_cuda() {
    clear_cuda_error_or_success(
        "orchestrator-worker",
        &["load", "--dummy", "--preset", "tiny", "--layers", "1", "--tp", "1", "--device", "cuda"],
    );
}

#[test]
fn launch_on_cuda_is_a_clear_error_without_cuda() {
    clear_cuda_error_or_success(
        "orchestrator",
        &["launch", "--tp", "1", "--dummy", "--preset", "tiny", "--layers", "1", "--device", "cuda"],
    );
}
