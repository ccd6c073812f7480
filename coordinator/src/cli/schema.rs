//! `schema`: the JSON Schema of each `--json` document.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use orchestrator_ops::output::emit;

use crate::schemas;

#[derive(Args)]
pub struct SchemaArgs {
    /// report, update, probe, manifest or verify-dump (default: list them).
    name: Option<String>,
    /// Write every schema as DIR/NAME.schema.json.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// Prints a schema or the list of them, or writes every one into `--out`.
pub fn schema_cmd(a: SchemaArgs) -> anyhow::Result<bool> {
    let all = schemas::all();
    if let Some(dir) = &a.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, _, schema) in &all {
            let path = dir.join(format!("{name}.schema.json"));
            std::fs::write(&path, schemas::text(schema)).with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(true);
    }
    match a.name {
        Some(name) => match all.iter().find(|(n, _, _)| *n == name) {
            Some((_, _, schema)) => emit(&schemas::text(schema)),
            None => anyhow::bail!("no schema `{name}`: one of {}", all.iter().map(|(n, _, _)| *n).collect::<Vec<_>>().join(", ")),
        },
        None => emit(&all.iter().map(|(n, by, _)| format!("{n:<12} {by}\n")).collect::<String>()),
    }
    Ok(true)
}
