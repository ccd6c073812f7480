//! `config.json` of a Hugging Face checkpoint (spec section 3): V4.1 keeps the model fields
//! under `text_config`, V4 at the top level; `quantization_config` says FP8 and its block size,
//! and is absent in a BF16 export.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::ModelError;
use crate::geometry::{Family, Geometry, WeightFormat};

/// What a checkpoint's `config.json` says about attention.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    pub family: Family,
    pub geometry: Geometry,
    pub format: WeightFormat,
}

fn field(obj: &Map<String, Value>, name: &'static str, file: &Path) -> Result<usize, ModelError> {
    let v = obj.get(name).ok_or_else(|| ModelError::Config { file: file.to_path_buf(), why: format!("missing field `{name}`") })?;
    v.as_u64().map(|n| n as usize).ok_or_else(|| ModelError::Config {
        file: file.to_path_buf(),
        why: format!("field `{name}` is {v}, expected a non-negative integer"),
    })
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

    /// Reads and checks `config.json`.
    pub fn read(file: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(file).map_err(|source| ModelError::Io { path: file.to_path_buf(), source })?;
        Self::parse(&text, file)
    }

    /// Parses `config.json` text (`file` names it in errors).
    pub fn parse(text: &str, file: &Path) -> Result<Self, ModelError> {
        let cfg_err = |why: String| ModelError::Config { file: file.to_path_buf(), why };
        let root: Value = serde_json::from_str(text).map_err(|e| cfg_err(format!("malformed JSON: {e}")))?;
        let root = root.as_object().ok_or_else(|| cfg_err("top level is not an object".into()))?;
        let (family, model) = match root.get("text_config") {
            Some(Value::Object(tc)) => (Family::V41, tc),
            Some(other) => return Err(cfg_err(format!("`text_config` is {other}, expected an object"))),
            None => (Family::V4, root),
        };
        let geometry = Geometry {
            hidden: field(model, "hidden_size", file)?,
            layers: field(model, "num_hidden_layers", file)?,
            heads: field(model, "num_attention_heads", file)?,
            kv_heads: field(model, "num_key_value_heads", file)?,
            head_dim: field(model, "head_dim", file)?,
            rope_dim: field(model, "qk_rope_head_dim", file)?,
            q_lora_rank: field(model, "q_lora_rank", file)?,
            o_lora_rank: field(model, "o_lora_rank", file)?,
            o_groups: field(model, "o_groups", file)?,
        };
        let quant = root.get("quantization_config").or_else(|| model.get("quantization_config"));
        let format = match quant {
            None | Some(Value::Null) => WeightFormat::Bf16,
            Some(Value::Object(q)) => parse_quantization(q).map_err(|why| cfg_err(format!("quantization_config: {why}")))?,
            Some(other) => return Err(cfg_err(format!("`quantization_config` is {other}, expected an object"))),
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

fn parse_quantization(q: &Map<String, Value>) -> Result<WeightFormat, String> {
    let s = |k: &str| q.get(k).and_then(Value::as_str);
    match s("quant_method") {
        Some("fp8") => {}
        other => return Err(format!("quant_method {other:?} is not supported (expected \"fp8\")")),
    }
    if let Some(fmt) = s("fmt")
        && fmt != "e4m3"
    {
        return Err(format!("fmt \"{fmt}\" is not supported (expected \"e4m3\")"));
    }
    if let Some(sf) = s("scale_fmt")
        && sf != "ue8m0"
    {
        return Err(format!("scale_fmt \"{sf}\" is not supported (expected \"ue8m0\")"));
    }
    let block = q
        .get("weight_block_size")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .and_then(|a| Some([a[0].as_u64()? as usize, a[1].as_u64()? as usize]))
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

    #[test]
    fn errors_name_the_field() {
        let text = r#"{"text_config": {"hidden_size": 64}}"#;
        let err = ModelConfig::parse(text, Path::new("x/config.json")).unwrap_err().to_string();
        assert!(err.contains("num_hidden_layers") && err.contains("x/config.json"), "{err}");
        let err = ModelConfig::parse("{not json", Path::new("c.json")).unwrap_err();
        assert!(matches!(err, ModelError::Config { .. }));
    }
}
