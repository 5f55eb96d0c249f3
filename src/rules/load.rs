//! Loading rules from files and directories and validating them, with every
//! error naming file, line and what is wrong. Directories are walked
//! recursively in name order, skipping dot entries (Kubernetes ConfigMap
//! mounts keep their real files under `..data`/`..<timestamp>` and expose them
//! through symlinks, which are followed).

use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::fields::FileCtx;
use super::RuleSet;

/// Loader settings.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Merge files that declare the same domain (the reference's
    /// MERGE_DOMAIN_CONFIG); otherwise a repeated domain is an error.
    pub merge_domains: bool,
}

/// One problem in one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleError {
    pub file: PathBuf,
    /// 1-based; 0 when the problem is not tied to a line (unreadable file).
    pub line: usize,
    pub message: String,
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line > 0 {
            write!(f, "{}:{}: {}", self.file.display(), self.line, self.message)
        } else {
            write!(f, "{}: {}", self.file.display(), self.message)
        }
    }
}

/// Every problem found in one load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleErrors(pub Vec<RuleError>);

impl fmt::Display for RuleErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for RuleErrors {}

/// A hash over the files under `paths` (names and contents): equal to the
/// `hash` of a successful [`load_paths`] of the same files, so the reloader
/// can tell cheaply whether anything changed.
pub fn fingerprint(paths: &[PathBuf]) -> String {
    let mut errors = Vec::new();
    let mut files = Vec::new();
    for path in paths {
        collect_files(path, &mut files, &mut errors);
    }
    let mut hasher = Sha256::new();
    for file in &files {
        // Streamed, so a huge file dropped into the directory is hashed,
        // not held in memory (loading it is then refused).
        hasher.update(file.to_string_lossy().as_bytes());
        hasher.update([0]);
        let copied = std::fs::File::open(file).and_then(|mut f| std::io::copy(&mut f, &mut hasher));
        if let Err(e) = copied {
            hasher.update(format!("unreadable {}: {e}", file.display()));
        }
        hasher.update([0]);
    }
    for e in &errors {
        hasher.update(e.to_string());
    }
    hex::encode(hasher.finalize())
}

fn hash_file(hasher: &mut Sha256, file: &Path, bytes: &[u8]) {
    hasher.update(file.to_string_lossy().as_bytes());
    hasher.update([0]);
    hasher.update(bytes);
    hasher.update([0]);
}

/// Loads and validates one file's text as the only rules file (what the
/// rules fuzz target drives; the same path as [`load_paths`] per file).
pub fn load_text(file: &Path, text: &str, opts: LoadOptions) -> Result<RuleSet, RuleErrors> {
    if text.len() as u64 > MAX_FILE_BYTES {
        let message = format!("file is larger than {MAX_FILE_BYTES} bytes; refused");
        return Err(RuleErrors(vec![err(file, 0, message)]));
    }
    let mut errors = Vec::new();
    let mut set = RuleSet::default();
    let mut hasher = Sha256::new();
    let mut domain_files = std::collections::HashMap::new();
    hash_file(&mut hasher, file, text.as_bytes());
    let mut ctx = FileCtx {
        file,
        errors: &mut errors,
    };
    ctx.load_file(text, opts, &mut set, &mut domain_files);
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    set.hash = hex::encode(hasher.finalize());
    set.files = vec![file.to_path_buf()];
    Ok(set)
}

/// Loads and validates every rules file under `paths`.
pub fn load_paths(paths: &[PathBuf], opts: LoadOptions) -> Result<RuleSet, RuleErrors> {
    let mut errors = Vec::new();
    let mut files = Vec::new();
    for path in paths {
        collect_files(path, &mut files, &mut errors);
    }
    let mut set = RuleSet::default();
    let mut hasher = Sha256::new();
    let mut domain_files: std::collections::HashMap<String, PathBuf> = Default::default();
    for file in &files {
        let text = match read_bounded(file) {
            Ok(t) => t,
            Err(e) => {
                errors.push(err(file, 0, e));
                continue;
            }
        };
        hash_file(&mut hasher, file, text.as_bytes());
        let mut ctx = FileCtx {
            file,
            errors: &mut errors,
        };
        ctx.load_file(&text, opts, &mut set, &mut domain_files);
    }
    if files.is_empty() && errors.is_empty() {
        let shown: Vec<_> = paths.iter().map(|p| p.display().to_string()).collect();
        errors.push(err(
            Path::new(&shown.join(", ")),
            0,
            "no rules files found".into(),
        ));
    }
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    set.hash = hex::encode(hasher.finalize());
    set.files = files;
    Ok(set)
}

/// Largest rules file read, in bytes. Real ones are kilobytes; a larger
/// file dropped into a watched directory is refused, not read into memory.
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// A file's text, read only up to [`MAX_FILE_BYTES`] (the length is checked
/// on what is read, not on metadata, which a growing file can outrun).
fn read_bounded(file: &Path) -> Result<String, String> {
    use std::io::Read as _;
    let f = std::fs::File::open(file).map_err(|e| format!("cannot read file: {e}"))?;
    let mut bytes = Vec::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read file: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "file is larger than {MAX_FILE_BYTES} bytes; refused"
        ));
    }
    String::from_utf8(bytes).map_err(|e| format!("cannot read file: not UTF-8 ({e})"))
}

pub(super) fn err(file: &Path, line: usize, message: String) -> RuleError {
    RuleError {
        file: file.to_path_buf(),
        line,
        message,
    }
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>, errors: &mut Vec<RuleError>) {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) => {
            errors.push(err(path, 0, format!("cannot read rules path: {e}")));
            return;
        }
    };
    if meta.is_file() {
        out.push(path.to_path_buf());
        return;
    }
    if !meta.is_dir() {
        return;
    }
    let entries = match std::fs::read_dir(path) {
        Ok(rd) => rd,
        Err(e) => {
            errors.push(err(path, 0, format!("cannot list directory: {e}")));
            return;
        }
    };
    let mut names: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    names.sort();
    for child in names {
        collect_files(&child, out, errors);
    }
}
