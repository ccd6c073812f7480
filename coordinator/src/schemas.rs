//! JSON Schemas (draft 2020-12) of every `--json` document, derived with `schemars` from the
//! types serde writes them from, so a schema cannot drift from the output. `docs/schemas/`
//! holds them (`orchestrator schema --out docs/schemas` writes them; a test keeps the files
//! equal to what this build derives), and the Python tests validate real outputs against them.

use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema};

/// (document, the commands that print it, its schema).
pub fn all() -> Vec<(&'static str, &'static str, Schema)> {
    fn titled<T: JsonSchema>(title: &str, description: &str) -> Schema {
        // The serialize contract: a field serde may leave out is not required.
        let mut s = SchemaSettings::draft2020_12().for_serialize().into_generator().into_root_schema_for::<T>();
        s.insert("title".into(), title.into());
        s.insert("description".into(), description.into());
        s
    }
    vec![
        (
            "report",
            "orchestrator launch --json, orchestrator coordinator --json, orchestrator report --json",
            titled::<crate::consistency::ConsistencyReport>(
                "orchestrator consistency report",
                "One row per rank and a verdict per cross-rank rule (launch, coordinator and report --json).",
            ),
        ),
        (
            "update",
            "orchestrator update --json",
            titled::<crate::update::UpdateDocument>(
                "orchestrator rolling update",
                "The update's steps and versions, and the consistency report after it (update --json).",
            ),
        ),
        (
            "probe",
            "orchestrator probe --json",
            titled::<crate::cli::load::ProbeDocument>(
                "orchestrator routed probe load",
                "Routed probes at a rate for a time: counts per replica and version, latency percentiles (probe --json).",
            ),
        ),
        (
            "manifest",
            "orchestrator checkpoint manifest --json",
            titled::<orchestrator_worker::manifest::Manifest>(
                "orchestrator expected-digest manifest",
                "Every TP rank's expected kernel tensors, rank digests, source digests and layout identity, with each tensor's \
                 digests in the known wrong layouts (checkpoint manifest --json).",
            ),
        ),
        (
            "verify-dump",
            "orchestrator verify-dump --json",
            titled::<orchestrator_worker::manifest::DumpVerdict>(
                "orchestrator dump verdict",
                "Each dumped rank checked against a manifest, with the most likely cause of every differing tensor (verify-dump --json).",
            ),
        ),
    ]
}

/// The schema file's text for `name`.
pub fn text(schema: &Schema) -> String {
    serde_json::to_string_pretty(schema).unwrap_or_default() + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/schemas/*.schema.json are what this build derives (`ORCHESTRATOR_BLESS=1` rewrites them).
    #[test]
    fn the_committed_schemas_are_what_the_types_derive() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/schemas");
        for (name, _, schema) in all() {
            let path = dir.join(format!("{name}.schema.json"));
            let want = text(&schema);
            if std::env::var_os("ORCHESTRATOR_BLESS").is_some() {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &want).unwrap();
            }
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(have == want, "{} is stale: run ORCHESTRATOR_BLESS=1 cargo test -p orchestrator-coordinator schemas", path.display());
        }
    }
}
