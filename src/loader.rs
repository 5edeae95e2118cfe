//! Loading an HF-style model directory: `config.json` (family chosen by `model_type`),
//! `model.safetensors` or a sharded `model.safetensors.index.json`, `tokenizer.json` and
//! `generation_config.json`.

use crate::config::EosIds;
use crate::config::ModelConfig;
use crate::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

#[cfg(feature = "hub")]
mod hub;
#[cfg(feature = "hub")]
pub use hub::HubOptions;

/// A model directory, parsed but with weights not yet read.
#[derive(Debug, Clone)]
pub struct ModelDir {
    pub path: PathBuf,
    pub config: ModelConfig,
    /// Union of the eos ids in `config.json` and `generation_config.json`, and the family's stop
    /// tokens the tokenizer has (`ModelConfig::stop_tokens`).
    pub eos_token_ids: Vec<u32>,
    pub weight_files: Vec<PathBuf>,
    pub tokenizer_file: Option<PathBuf>,
    /// The chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template`: a string, or the entry named `default` of a list) and the special
    /// tokens it is rendered with.
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Where an FP8 checkpoint keeps its weights' scales (`config.json`'s
    /// `quantization_config`); `None` for a checkpoint in a float dtype.
    pub stored_fp8: Option<crate::quant::CheckpointQuant>,
    /// The tokenizer when opening had to parse it already (stop tokens), so it is parsed once.
    parsed_tokenizer: Option<tokenizers::Tokenizer>,
}

impl ModelDir {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let config_path = path.join("config.json");
        let text = read(&config_path)?;
        let config = ModelConfig::from_json(&text, &config_path.display().to_string())?;
        let raw: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::config(config_path.display().to_string(), e.to_string()))?;
        let stored_fp8 = crate::quant::CheckpointQuant::from_config(&raw, &config_path.display().to_string())?;
        let mut eos = config.eos_token_ids();
        let gen_path = path.join("generation_config.json");
        if gen_path.exists() {
            #[derive(serde::Deserialize)]
            struct Gen {
                eos_token_id: Option<EosIds>,
            }
            let g: Gen = serde_json::from_str(&read(&gen_path)?).map_err(|e| Error::config(gen_path.display().to_string(), e.to_string()))?;
            eos.extend(g.eos_token_id.map(|e| e.to_vec()).unwrap_or_default());
        }
        let tok = path.join("tokenizer.json");
        // Family stop tokens that neither config names (LLaDA2.0's end of turn), by the
        // tokenizer's id for them.
        let mut parsed_tokenizer = None;
        if !config.stop_tokens().is_empty() && tok.exists() {
            let t = parse_tokenizer(&tok)?;
            eos.extend(config.stop_tokens().iter().filter_map(|s| t.token_to_id(s)));
            parsed_tokenizer = Some(t);
        }
        eos.sort_unstable();
        eos.dedup();
        let weight_files = weight_files(&path)?;
        let chat = ChatFiles::read(&path)?;
        Ok(Self {
            tokenizer_file: tok.exists().then_some(tok),
            path,
            config,
            eos_token_ids: eos,
            weight_files,
            chat_template: chat.template,
            bos_token: chat.bos_token,
            eos_token: chat.eos_token,
            stored_fp8,
            parsed_tokenizer,
        })
    }

    /// Memory-maps the weights, converting to `dtype` on `device` as tensors are read.
    pub fn weights(&self, dtype: DType, device: &Device) -> Result<Weights> {
        Ok(Weights::from_files(&self.weight_files, dtype, device)?.with_stored_fp8(self.stored_fp8.clone()))
    }

    /// The compiled chat template, if the checkpoint has one.
    pub fn chat(&self) -> Result<Option<crate::chat::ChatTemplate>> {
        self.chat_template.as_ref().map(|t| crate::chat::ChatTemplate::new(t.clone(), self.bos_token.clone(), self.eos_token.clone())).transpose()
    }

    pub fn tokenizer(&self) -> Result<Option<tokenizers::Tokenizer>> {
        if let Some(t) = &self.parsed_tokenizer {
            return Ok(Some(t.clone()));
        }
        self.tokenizer_file.as_deref().map(parse_tokenizer).transpose()
    }

    /// Downloads `repo` ("owner/name") from the Hugging Face hub into the hub cache and opens
    /// it: [`Self::from_hub_with`] with the hub's defaults ([`HubOptions::default`]).
    #[cfg(feature = "hub")]
    pub fn from_hub(repo: &str) -> Result<Self> {
        Self::from_hub_with(repo, &HubOptions::default())
    }

    /// Downloads `repo` ("owner/name") from the hub `options` name into its cache and opens the
    /// snapshot ([`Self::path`] is the snapshot directory, inside the cache).
    ///
    /// Only the files a model needs are fetched — `config.json`, `generation_config.json`,
    /// `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` and the safetensors
    /// (single, sharded with their index, exit gates) at the repository's top level — and
    /// only those not in the cache already; the hub is still asked which commit the revision
    /// is and which files it holds. When the hub cannot be reached (no connection, a timeout,
    /// a 5xx answer), the snapshot the cache holds for the revision is opened instead.
    ///
    /// Errors: [`Error::Hub`] with [`crate::HubError::RepoNotFound`],
    /// [`RevisionNotFound`](crate::HubError::RevisionNotFound),
    /// [`FileNotFound`](crate::HubError::FileNotFound) (listed, not served),
    /// [`Unauthorized`](crate::HubError::Unauthorized) or
    /// [`Other`](crate::HubError::Other); a repository that downloads but is no checkpoint
    /// gives the error [`Self::open`] gives for it.
    #[cfg(feature = "hub")]
    pub fn from_hub_with(repo: &str, options: &HubOptions) -> Result<Self> {
        Self::open(hub::download(repo, options)?)
    }
}

/// What `tokenizer_config.json` and `chat_template.jinja` say about chat.
#[derive(Debug, Default)]
struct ChatFiles {
    template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatFiles {
    fn read(dir: &Path) -> Result<Self> {
        /// A special token as a string or as an added-token object `{"content": …}`.
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Token {
            Text(String),
            Added { content: String },
        }
        /// A template, or named templates (`[{"name": "default", "template": …}, …]`).
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Template {
            One(String),
            Named(Vec<Named>),
        }
        #[derive(serde::Deserialize)]
        struct Named {
            name: String,
            template: String,
        }
        #[derive(serde::Deserialize)]
        struct TokenizerConfig {
            chat_template: Option<Template>,
            bos_token: Option<Token>,
            eos_token: Option<Token>,
        }
        let mut files = Self::default();
        let config_path = dir.join("tokenizer_config.json");
        if config_path.exists() {
            let c: TokenizerConfig = serde_json::from_str(&read(&config_path)?).map_err(|e| Error::config(config_path.display().to_string(), e.to_string()))?;
            let text = |t: Token| match t {
                Token::Text(s) | Token::Added { content: s } => s,
            };
            files.bos_token = c.bos_token.map(text);
            files.eos_token = c.eos_token.map(text);
            files.template = match c.chat_template {
                Some(Template::One(t)) => Some(t),
                Some(Template::Named(list)) => {
                    let default = list.iter().position(|n| n.name == "default").unwrap_or(0);
                    list.into_iter().nth(default).map(|n| n.template)
                }
                None => None,
            };
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            files.template = Some(read(&jinja)?);
        }
        Ok(files)
    }
}

/// candle errors carry a backtrace after the message; users want the message.
fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().to_string()
}

/// Most bytes a checkpoint's metadata file (config, tokenizer, chat template) may hold: far above
/// any release's (a 256 k-token `tokenizer.json` is ≈ 30 MB).
const MAX_METADATA_BYTES: u64 = 256 << 20;

/// A metadata file's bytes: a regular file (not a directory, a FIFO that would block, or a
/// device such as `/dev/zero` that never ends) of at most [`MAX_METADATA_BYTES`], checked before
/// reading and bounded while reading.
pub(crate) fn read_bounded(p: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let io = |source: std::io::Error| Error::Io { path: p.to_path_buf(), source };
    let refused = |why: String| io(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
    let meta = std::fs::metadata(p).map_err(io)?;
    if !meta.is_file() {
        return Err(refused("not a regular file".into()));
    }
    if meta.len() > MAX_METADATA_BYTES {
        return Err(refused(format!("{} bytes, above the {} MiB a metadata file may hold", meta.len(), MAX_METADATA_BYTES >> 20)));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(p).map_err(io)?.take(MAX_METADATA_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_METADATA_BYTES {
        return Err(refused(format!("grew past the {} MiB a metadata file may hold while read", MAX_METADATA_BYTES >> 20)));
    }
    Ok(bytes)
}

fn read(p: &Path) -> Result<String> {
    String::from_utf8(read_bounded(p)?).map_err(|e| Error::Io { path: p.to_path_buf(), source: std::io::Error::new(std::io::ErrorKind::InvalidData, e) })
}

fn shard_names(index: &Path) -> Result<BTreeSet<String>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let idx: Index = serde_json::from_str(&read(index)?).map_err(|e| Error::config(index.display().to_string(), e.to_string()))?;
    let names: BTreeSet<String> = idx.weight_map.into_values().collect();
    // A shard is a file beside the index: no path that leaves the checkpoint's directory.
    if let Some(bad) = names.iter().find(|n| Path::new(n).file_name().is_none_or(|f| f != n.as_str())) {
        return Err(Error::config(index.display().to_string(), format!("shard `{bad}` is not a file name in the checkpoint's directory")));
    }
    Ok(names)
}

fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        return Ok(shard_names(&index)?.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::Io { path: single, source: std::io::Error::new(std::io::ErrorKind::NotFound, "no model.safetensors or model.safetensors.index.json") })
}

/// A tensor stored in two shards would be read from whichever was mapped last: refused, naming both.
fn no_tensor_in_two_shards(files: &[PathBuf]) -> Result<()> {
    let mut seen: HashMap<String, &PathBuf> = HashMap::new();
    for f in files {
        // SAFETY: as in `Weights::from_files`, read-only and only the header is read.
        let st = unsafe { MmapedSafetensors::new(f) }.map_err(|e| Error::tensor(f.display().to_string(), first_line(&e.to_string())))?;
        for (name, _) in st.tensors() {
            if let Some(other) = seen.insert(name.clone(), f) {
                return Err(Error::tensor(name, format!("stored in two shards, {} and {}", other.display(), f.display())));
            }
        }
    }
    Ok(())
}

enum Source {
    Mmap(MmapedSafetensors),
    Map(HashMap<String, Tensor>),
    /// Tensors made when read (random weights too large to hold twice): their shapes, and what
    /// makes one.
    Lazy(HashMap<String, Vec<usize>>, MakeTensor),
}

/// Makes the tensor of a name and shape ([`Weights::lazy`]).
pub type MakeTensor = std::sync::Arc<dyn Fn(&str, &[usize]) -> candle_core::Result<Tensor> + Send + Sync>;

/// Named checkpoint tensors with checked shapes, converted to one dtype on one device.
pub struct Weights {
    source: Source,
    dtype: DType,
    device: Device,
    /// How [`Weights::linear`] stores the linear layers a model builds.
    quantization: crate::quant::Quantization,
    /// Where the checkpoint keeps its FP8 weights' scales, if it stores weights in FP8.
    stored_fp8: Option<crate::quant::CheckpointQuant>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weights({:?}, {:?})", self.dtype, self.device)
    }
}

impl Weights {
    pub fn from_files(files: &[PathBuf], dtype: DType, device: &Device) -> Result<Self> {
        for f in files {
            if !f.exists() {
                return Err(Error::Io { path: f.clone(), source: std::io::Error::new(std::io::ErrorKind::NotFound, "weight file missing") });
            }
        }
        // SAFETY: the files are mapped read-only; as with every mmap-based loader, they must
        // not be modified while the engine is loading from them.
        let st = unsafe { MmapedSafetensors::multi(files) }
            .map_err(|e| Error::tensor(files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(","), first_line(&e.to_string())))?;
        if files.len() > 1 {
            no_tensor_in_two_shards(files)?;
        }
        Ok(Self { source: Source::Mmap(st), dtype, device: device.clone(), quantization: Default::default(), stored_fp8: None })
    }

    /// Weights already in memory (random-weight benchmarks, tests).
    pub fn from_map(map: HashMap<String, Tensor>, dtype: DType, device: &Device) -> Self {
        Self { source: Source::Map(map), dtype, device: device.clone(), quantization: Default::default(), stored_fp8: None }
    }

    /// The linear layers a model builds from these weights are stored as `q` says
    /// ([`crate::quant::Quantization`]).
    pub fn with_quantization(mut self, q: crate::quant::Quantization) -> Self {
        self.quantization = q;
        self
    }

    pub fn quantization(&self) -> crate::quant::Quantization {
        self.quantization
    }

    /// The checkpoint stores (some) weights in FP8, their scales laid out as `layout` says.
    pub fn with_stored_fp8(mut self, layout: Option<crate::quant::CheckpointQuant>) -> Self {
        self.stored_fp8 = layout;
        self
    }

    /// The linear layer over the weights `parts` (name, `[out, in]`) stacked along the output
    /// rows (q, k, v; gate, up), and `bias`. Weights the checkpoint stores in FP8 stay in FP8
    /// with their scales when every part is; otherwise every part is read in the model dtype
    /// (an FP8 one dequantized) and stored as [`Weights::with_quantization`] says.
    pub fn linear_cat(&self, parts: &[(String, (usize, usize))], bias: Option<Tensor>) -> Result<crate::ops::Linear> {
        let stored: Vec<Option<crate::quant::Fp8Weight>> = parts.iter().map(|(name, shape)| self.stored_fp8_weight(name, *shape)).collect::<Result<_>>()?;
        if let Some(fp8) = stored.iter().cloned().collect::<Option<Vec<_>>>() {
            // Parts whose block scales do not join (a part ending inside a tile) run dense below.
            let joined = if fp8.len() == 1 { Ok(fp8.into_iter().next().expect("one part")) } else { crate::quant::Fp8Weight::cat_rows(&fp8) };
            if let Ok(w) = joined {
                return Ok(crate::ops::Linear::fp8(w, bias, self.dtype)?);
            }
        }
        let dense = parts
            .iter()
            .zip(stored)
            .map(|((name, shape), fp8)| match fp8 {
                Some(w) => Ok(w.dequantize(self.dtype)?),
                None => self.get(*shape, name),
            })
            .collect::<Result<Vec<_>>>()?;
        let w = if dense.len() == 1 { dense.into_iter().next().expect("one part") } else { Tensor::cat(&dense, 0)? };
        self.linear(w, bias)
    }

    /// A weight matrix `name` in the model dtype, dequantized if the checkpoint stores it in
    /// FP8: for the weights a model keeps dense (routed experts).
    pub fn get_dense(&self, shape: (usize, usize), name: &str) -> Result<Tensor> {
        match self.stored_fp8_weight(name, shape)? {
            Some(w) => Ok(w.dequantize(self.dtype)?),
            None => self.get(shape, name),
        }
    }

    /// Weights made when a model reads them, by `make(name, shape)` for each of `manifest`: a
    /// model in released shapes with random weights, each rank of a tensor-parallel group
    /// making only the parts it keeps (a model that does not fit one device, never held whole).
    pub fn lazy(manifest: &[(String, Vec<usize>)], make: MakeTensor, dtype: DType, device: &Device) -> Self {
        let shapes = manifest.iter().cloned().collect();
        Self { source: Source::Lazy(shapes, make), dtype, device: device.clone(), quantization: Default::default(), stored_fp8: None }
    }

    /// `name` with its scales, if the checkpoint stores it in FP8.
    fn stored_fp8_weight(&self, name: &str, shape: (usize, usize)) -> Result<Option<crate::quant::Fp8Weight>> {
        use crate::quant::{Fp8Scale, Fp8Weight};
        let Some(layout) = &self.stored_fp8 else { return Ok(None) };
        // Looked up before it is read: a part stored in a float dtype is read once, by `get`.
        let stored_fp8 = match &self.source {
            Source::Mmap(st) => st.get(name).is_ok_and(|v| v.dtype() == safetensors::Dtype::F8_E4M3),
            Source::Map(m) => m.get(name).is_some_and(|t| t.dtype() == DType::F8E4M3),
            Source::Lazy(..) => false,
        };
        if !stored_fp8 {
            return Ok(None);
        }
        let data = self.raw(name)?;
        if data.dims() != [shape.0, shape.1] {
            return Err(Error::tensor(name, format!("shape {:?}, expected {:?}", data.dims(), [shape.0, shape.1])));
        }
        let scale_name = layout.scale_name(name);
        let s = self.raw(&scale_name).map_err(|_| Error::tensor(&scale_name, format!("missing: the FP8 weight `{name}` needs its scales")))?;
        let bad = |why: String| Error::tensor(&scale_name, why);
        if !crate::ops::is_float(s.dtype()) || s.dtype() == DType::F8E4M3 {
            return Err(bad(format!("dtype {:?} is not a scale's (f32, bf16 or f16)", s.dtype())));
        }
        let s = s.to_dtype(DType::F32)?;
        let scale = match layout.block() {
            Some(block) => Fp8Scale::Block { scale: s, block },
            // Per output channel `[out, 1]` (or `[out]`), or one for the tensor.
            None => match s.dims() {
                [o, 1] | [o] if *o == shape.0 => Fp8Scale::PerChannel(s.flatten_all()?),
                [] | [1] | [1, 1] => Fp8Scale::PerChannel(s.flatten_all()?.broadcast_as(shape.0)?.contiguous()?),
                d => return Err(bad(format!("shape {d:?} is neither per channel ([{}, 1]) nor per tensor", shape.0))),
            },
        };
        let w = Fp8Weight::from_parts(data, scale).map_err(|e| bad(first_line(&e.to_string())))?;
        Ok(Some(w.to_device(&self.device)?))
    }

    /// `name` as stored, on the CPU.
    fn raw(&self, name: &str) -> Result<Tensor> {
        match &self.source {
            Source::Mmap(st) => {
                if st.get(name).is_err() {
                    return Err(Error::tensor(name, "missing from the checkpoint"));
                }
                st.load(name, &Device::Cpu).map_err(|e| Error::tensor(name, first_line(&e.to_string())))
            }
            Source::Map(m) => m.get(name).cloned().ok_or_else(|| Error::tensor(name, "missing")),
            Source::Lazy(shapes, make) => {
                let shape = shapes.get(name).ok_or_else(|| Error::tensor(name, "missing"))?;
                make(name, shape).map_err(|e| Error::tensor(name, first_line(&e.to_string())))
            }
        }
    }

    /// A linear layer over `weight` `[out, in]` (and `bias`), stored as the weights'
    /// quantization says: what models build their projections and MLPs with.
    pub fn linear(&self, weight: Tensor, bias: Option<Tensor>) -> Result<crate::ops::Linear> {
        Ok(crate::ops::Linear::quantized(weight, bias, self.quantization)?)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Mmap(st) => st.get(name).is_ok(),
            Source::Map(m) => m.contains_key(name),
            Source::Lazy(shapes, _) => shapes.contains_key(name),
        }
    }

    /// Checks that the checkpoint holds exactly the layers `prefix.0 ..= prefix.{n-1}` the
    /// config asks for, before anything is allocated per layer: a config that names more
    /// layers than the file holds (or fewer: the model would silently drop some) is
    /// [`Error::BadConfig`].
    pub fn check_layer_count(&self, prefix: &str, n: usize, what: &str) -> Result<()> {
        let start = format!("{prefix}.");
        let index = |name: &str| name.strip_prefix(&start).and_then(|rest| rest.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        let present = match &self.source {
            Source::Mmap(st) => st.tensors().iter().filter_map(|(name, _)| index(name)).max(),
            Source::Map(m) => m.keys().filter_map(|name| index(name)).max(),
            Source::Lazy(shapes, _) => shapes.keys().filter_map(|name| index(name)).max(),
        }
        .map_or(0, |i| i.saturating_add(1));
        if present != n {
            return Err(Error::config(what, format!("{n} layers configured, the checkpoint holds {present} under `{prefix}`")));
        }
        Ok(())
    }

    /// Reads `name`, checks its shape, converts it to the model dtype and device.
    pub fn get<S: Into<Shape>>(&self, shape: S, name: &str) -> Result<Tensor> {
        self.get_as(shape, name, self.dtype)
    }

    /// [`Weights::get`] converting from the stored dtype straight to `dtype` (an f32 router read
    /// from a checkpoint served in bf16 keeps its precision).
    pub fn get_as<S: Into<Shape>>(&self, shape: S, name: &str, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let t = self.raw(name)?;
        if t.dtype() == DType::F8E4M3 {
            // Its values mean nothing without its scales, which only a linear layer reads.
            let why = match self.stored_fp8 {
                None => "stored in FP8, but config.json has no quantization_config saying where its scales are",
                Some(_) => "stored in FP8 where the model reads no FP8 weight (a norm, embedding, router or head)",
            };
            return Err(Error::tensor(name, why));
        }
        if t.shape() != &shape {
            return Err(Error::tensor(name, format!("shape {:?}, expected {:?}", t.dims(), shape.dims())));
        }
        if !crate::ops::is_float(t.dtype()) {
            return Err(Error::tensor(name, format!("dtype {:?} is not a float type", t.dtype())));
        }
        Ok(t.to_dtype(dtype)?.to_device(&self.device)?)
    }
}

fn parse_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    crate::tokenizer::parse(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_count_check_survives_any_layer_index() {
        let t = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
        let map = HashMap::from([("model.layers.0.w".to_string(), t.clone()), ("model.layers.18446744073709551615.junk".to_string(), t)]);
        let w = Weights::from_map(map, DType::F32, &Device::Cpu);
        assert!(matches!(w.check_layer_count("model.layers", 1, "cfg"), Err(Error::BadConfig { .. })));
    }
}
