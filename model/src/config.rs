//! `config.json` of a Hugging Face checkpoint (spec section 3): V4.1 keeps the model fields
//! under `text_config`, V4 at the top level; `quantization_config` says FP8 and its block size,
//! and is absent in a BF16 export.

use std::io::Read as _;
use std::path::Path;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::ModelError;
use crate::geometry::{Family, Geometry, WeightFormat};
use crate::limits;

/// What a checkpoint's `config.json` says about attention.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    pub family: Family,
    pub geometry: Geometry,
    pub format: WeightFormat,
}

/// The fields of one `config.json` object the parser looks at, borrowed as raw JSON text;
/// every other field is skipped without being built, so no part of the file is expanded into
/// a larger in-memory tree (a JSON `null` counts as absent).
#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow, default)]
    text_config: Option<&'a RawValue>,
    #[serde(borrow, default)]
    quantization_config: Option<&'a RawValue>,
    #[serde(borrow, default)]
    hidden_size: Option<&'a RawValue>,
    #[serde(borrow, default)]
    num_hidden_layers: Option<&'a RawValue>,
    #[serde(borrow, default)]
    num_attention_heads: Option<&'a RawValue>,
    #[serde(borrow, default)]
    num_key_value_heads: Option<&'a RawValue>,
    #[serde(borrow, default)]
    head_dim: Option<&'a RawValue>,
    #[serde(borrow, default)]
    qk_rope_head_dim: Option<&'a RawValue>,
    #[serde(borrow, default)]
    q_lora_rank: Option<&'a RawValue>,
    #[serde(borrow, default)]
    o_lora_rank: Option<&'a RawValue>,
    #[serde(borrow, default)]
    o_groups: Option<&'a RawValue>,
}

/// `quantization_config`'s fields, raw.
#[derive(Deserialize)]
struct QuantFields<'a> {
    #[serde(borrow, default)]
    quant_method: Option<&'a RawValue>,
    #[serde(borrow, default)]
    fmt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    scale_fmt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    weight_block_size: Option<&'a RawValue>,
}

/// At most 64 characters of a raw JSON value, for messages.
pub(crate) fn excerpt(raw: &str) -> String {
    let mut out: String = raw.chars().take(64).collect();
    if out.len() < raw.len() {
        out.push_str("...");
    }
    out
}

/// An object's fields, refusing anything but a JSON object (serde would otherwise read a
/// JSON array into a struct by position).
fn object<'a, T: Deserialize<'a>>(raw: &'a str) -> Result<T, String> {
    if !raw.trim_start().starts_with('{') {
        return Err(format!("is {}, expected an object", excerpt(raw.trim_start())));
    }
    serde_json::from_str(raw).map_err(|e| format!("malformed JSON: {e}"))
}

/// Reads a whole file of at most `limit` bytes ([`ModelError::FileTooLarge`] above it, before
/// anything is read).
pub(crate) fn read_bounded(file: &Path, limit: u64) -> Result<Vec<u8>, ModelError> {
    let io = |source| ModelError::Io { path: file.to_path_buf(), source };
    crate::regular_file(file)?;
    let f = std::fs::File::open(file).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len > limit {
        return Err(ModelError::FileTooLarge { file: file.to_path_buf(), bytes: len, limit });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    f.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(ModelError::FileTooLarge { file: file.to_path_buf(), bytes: bytes.len() as u64, limit });
    }
    Ok(bytes)
}

fn field(raw: Option<&RawValue>, name: &'static str, file: &Path) -> Result<usize, ModelError> {
    let cfg_err = |why: String| ModelError::Config { file: file.to_path_buf(), why };
    let v = raw.ok_or_else(|| cfg_err(format!("missing field `{name}`")))?;
    serde_json::from_str::<u64>(v.get())
        .ok()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| cfg_err(format!("field `{name}` is {}, expected a non-negative integer", excerpt(v.get()))))
}

impl ModelConfig {
    /// A preset's configuration with `layers` layers (default: the preset's), FP8 with the
    /// family's block size or BF16; validated.
    pub fn from_preset(preset: crate::Preset, layers: Option<usize>, bf16: bool) -> Result<Self, ModelError> {
        let mut geometry = preset.geometry();
        if let Some(l) = layers {
            geometry.layers = l;
        }
        let format = if bf16 { WeightFormat::Bf16 } else { WeightFormat::Fp8 { block: preset.fp8_block() } };
        geometry.validate(format.block())?;
        Ok(Self { family: preset.family(), geometry, format })
    }

    /// Reads and checks `config.json` (at most [`limits::MAX_CONFIG_BYTES`]).
    pub fn read(file: &Path) -> Result<Self, ModelError> {
        let bytes = read_bounded(file, limits::MAX_CONFIG_BYTES)?;
        let text =
            std::str::from_utf8(&bytes).map_err(|e| ModelError::Config { file: file.to_path_buf(), why: format!("not UTF-8: {e}") })?;
        Self::parse(text, file)
    }

    /// Parses `config.json` text (`file` names it in errors). Only the attention fields are
    /// looked at (borrowed, never copied into a JSON tree); each is checked against its limit
    /// in [`crate::limits`] by [`Geometry::validate`] before anything is sized by it.
    pub fn parse(text: &str, file: &Path) -> Result<Self, ModelError> {
        let cfg_err = |why: String| ModelError::Config { file: file.to_path_buf(), why };
        if !text.trim_start().starts_with('{') {
            return Err(match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                Err(e) => cfg_err(format!("malformed JSON: {e}")),
                Ok(_) => cfg_err("top level is not an object".into()),
            });
        }
        let root: Fields = object(text).map_err(cfg_err)?;
        let (family, nested) = match root.text_config {
            Some(tc) => (Family::V41, Some(object::<Fields>(tc.get()).map_err(|why| cfg_err(format!("`text_config` {why}")))?)),
            None => (Family::V4, None),
        };
        let model = nested.as_ref().unwrap_or(&root);
        let geometry = Geometry {
            hidden: field(model.hidden_size, "hidden_size", file)?,
            layers: field(model.num_hidden_layers, "num_hidden_layers", file)?,
            heads: field(model.num_attention_heads, "num_attention_heads", file)?,
            kv_heads: field(model.num_key_value_heads, "num_key_value_heads", file)?,
            head_dim: field(model.head_dim, "head_dim", file)?,
            rope_dim: field(model.qk_rope_head_dim, "qk_rope_head_dim", file)?,
            q_lora_rank: field(model.q_lora_rank, "q_lora_rank", file)?,
            o_lora_rank: field(model.o_lora_rank, "o_lora_rank", file)?,
            o_groups: field(model.o_groups, "o_groups", file)?,
        };
        let format = match root.quantization_config.or(model.quantization_config) {
            None => WeightFormat::Bf16,
            Some(q) => {
                let q: QuantFields = object(q.get()).map_err(|why| cfg_err(format!("`quantization_config` {why}")))?;
                parse_quantization(&q).map_err(|why| cfg_err(format!("quantization_config: {why}")))?
            }
        };
        geometry.validate(format.block())?;
        Ok(Self { family, geometry, format })
    }

    /// The `config.json` text of a checkpoint with this configuration (V4.1: `text_config`).
    pub fn to_json(&self, extra: Option<Value>) -> Value {
        let g = &self.geometry;
        let model = json!({
            "hidden_size": g.hidden,
            "num_hidden_layers": g.layers,
            "num_attention_heads": g.heads,
            "num_key_value_heads": g.kv_heads,
            "head_dim": g.head_dim,
            "qk_rope_head_dim": g.rope_dim,
            "q_lora_rank": g.q_lora_rank,
            "o_lora_rank": g.o_lora_rank,
            "o_groups": g.o_groups,
            "sliding_window": 128,
            "rms_norm_eps": 1e-6,
        });
        let mut root = match self.family {
            Family::V41 => json!({
                "architectures": ["DeepseekV41ForCausalLM"],
                "model_type": "deepseek_v41",
                "text_config": model,
            }),
            Family::V4 => {
                let mut m = model;
                m["architectures"] = json!(["DeepseekV4ForCausalLM"]);
                m["model_type"] = json!("deepseek_v4");
                m
            }
        };
        if let WeightFormat::Fp8 { block } = self.format {
            root["quantization_config"] = json!({
                "quant_method": "fp8",
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "weight_block_size": block,
            });
        }
        if let Some(extra) = extra {
            root["orchestrator"] = extra;
        }
        root
    }
}

fn parse_quantization(q: &QuantFields) -> Result<WeightFormat, String> {
    let s = |raw: Option<&RawValue>| raw.map(|r| serde_json::from_str::<String>(r.get()).map_err(|_| excerpt(r.get())));
    match s(q.quant_method) {
        Some(Ok(m)) if m == "fp8" => {}
        Some(Ok(m)) => return Err(format!("quant_method \"{}\" is not supported (expected \"fp8\")", excerpt(&m))),
        Some(Err(raw)) => return Err(format!("quant_method {raw} is not supported (expected \"fp8\")")),
        None => return Err("quant_method is missing (expected \"fp8\")".into()),
    }
    match s(q.fmt) {
        None => {}
        Some(Ok(f)) if f == "e4m3" => {}
        Some(Ok(f)) => return Err(format!("fmt \"{}\" is not supported (expected \"e4m3\")", excerpt(&f))),
        Some(Err(raw)) => return Err(format!("fmt {raw} is not supported (expected \"e4m3\")")),
    }
    match s(q.scale_fmt) {
        None => {}
        Some(Ok(f)) if f == "ue8m0" => {}
        Some(Ok(f)) => return Err(format!("scale_fmt \"{}\" is not supported (expected \"ue8m0\")", excerpt(&f))),
        Some(Err(raw)) => return Err(format!("scale_fmt {raw} is not supported (expected \"ue8m0\")")),
    }
    let block = q
        .weight_block_size
        .and_then(|r| serde_json::from_str::<[u64; 2]>(r.get()).ok())
        .and_then(|[a, b]| Some([usize::try_from(a).ok()?, usize::try_from(b).ok()?]))
        .ok_or_else(|| "weight_block_size must be [rows, cols]".to_string())?;
    Ok(WeightFormat::Fp8 { block })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Preset;

    #[test]
    fn round_trips_both_families() {
        for (p, format) in [
            (Preset::Dsv41Flash, WeightFormat::Fp8 { block: [32, 32] }),
            (Preset::Dsv4Pro, WeightFormat::Fp8 { block: [128, 128] }),
            (Preset::Tiny, WeightFormat::Bf16),
        ] {
            let cfg = ModelConfig { family: p.family(), geometry: p.geometry(), format };
            let text = cfg.to_json(None).to_string();
            assert_eq!(ModelConfig::parse(&text, Path::new("config.json")).unwrap(), cfg);
        }
    }

    fn with(preset: Preset, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
        let cfg =
            ModelConfig { family: preset.family(), geometry: preset.geometry(), format: WeightFormat::Fp8 { block: preset.fp8_block() } };
        let mut v = cfg.to_json(None);
        let model = match preset.family() {
            Family::V41 => v["text_config"].as_object_mut().unwrap(),
            Family::V4 => v.as_object_mut().unwrap(),
        };
        edit(model);
        v.to_string()
    }

    #[test]
    fn absurd_sizes_are_refused_quickly_by_field() {
        let start = std::time::Instant::now();
        let file = Path::new("ck/config.json");
        for (heads, groups) in [(8u64 << 34, 1u64 << 34), (8 << 58, 1 << 58), (u64::MAX - 7, u64::MAX / 8)] {
            let text = with(Preset::Dsv41Flash, |m| {
                m.insert("num_attention_heads".into(), heads.into());
                m.insert("o_groups".into(), groups.into());
            });
            let err = ModelConfig::parse(&text, file).unwrap_err();
            assert!(matches!(err, ModelError::Geometry { field: "num_attention_heads", .. }), "{heads}: {err:?}");
            assert!(err.to_string().contains("MAX_HEADS"), "{err}");
        }
        let text = with(Preset::Dsv4Pro, |m| {
            m.insert("num_hidden_layers".into(), 1_000_000_000_000u64.into());
        });
        let err = ModelConfig::parse(&text, file).unwrap_err();
        assert!(matches!(err, ModelError::Geometry { field: "num_hidden_layers", .. }), "{err:?}");
        for (field, name) in
            [("hidden_size", "hidden_size"), ("q_lora_rank", "q_lora_rank"), ("o_lora_rank", "o_lora_rank"), ("o_groups", "o_groups")]
        {
            let text = with(Preset::Dsv41Flash, |m| {
                m.insert(field.into(), (1u64 << 40).into());
            });
            let err = ModelConfig::parse(&text, file).unwrap_err();
            assert!(matches!(&err, ModelError::Geometry { field: f, .. } if *f == name), "{field}: {err:?}");
        }
        let text = with(Preset::Dsv41Flash, |m| {
            m.insert("hidden_size".into(), serde_json::json!(1e300));
        });
        assert!(matches!(ModelConfig::parse(&text, file), Err(ModelError::Config { .. })));
        assert!(start.elapsed() < std::time::Duration::from_secs(2), "{:?}", start.elapsed());
    }

    #[test]
    fn real_presets_stay_within_the_limits() {
        for p in [Preset::Dsv41Flash, Preset::Dsv4Flash, Preset::Dsv4Pro, Preset::Tiny] {
            let text = with(p, |_| {});
            let cfg = ModelConfig::parse(&text, Path::new("config.json")).unwrap();
            assert_eq!(cfg.geometry, p.geometry());
            let sizes = crate::plan::valid_tp_sizes(&cfg.geometry);
            assert!(sizes.contains(&8), "{p:?}: {sizes:?}");
        }
        assert_eq!(crate::plan::valid_tp_sizes(&Preset::Dsv4Pro.geometry()), vec![1, 2, 4, 8, 16]);
        assert!(ModelConfig::from_preset(Preset::Dsv4Pro, Some(limits::MAX_LAYERS), false).is_ok());
        assert!(matches!(
            ModelConfig::from_preset(Preset::Dsv4Pro, Some(limits::MAX_LAYERS + 1), false),
            Err(ModelError::Geometry { field: "num_hidden_layers", .. })
        ));
    }

    #[test]
    fn oversized_config_files_are_not_read() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("config.json");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(limits::MAX_CONFIG_BYTES + 1).unwrap();
        let err = ModelConfig::read(&path).unwrap_err();
        assert!(matches!(&err, ModelError::FileTooLarge { file, .. } if file == &path), "{err:?}");
    }

    #[test]
    fn errors_name_the_field() {
        let text = r#"{"text_config": {"hidden_size": 64}}"#;
        let err = ModelConfig::parse(text, Path::new("x/config.json")).unwrap_err().to_string();
        assert!(err.contains("num_hidden_layers") && err.contains("x/config.json"), "{err}");
        let err = ModelConfig::parse("{not json", Path::new("c.json")).unwrap_err();
        assert!(matches!(err, ModelError::Config { .. }));
    }
}
