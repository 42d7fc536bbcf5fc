//! Generates the warden.v1 code with a vendored `protoc`, so the build needs no system protoc,
//! and, from the same descriptors, a `CheckStrings` impl per message: the walk over every
//! string a request carries that the server codec (`src/codec.rs`) runs on each decoded
//! request. Generating it from the descriptors means a string field added to any request
//! later is checked without anyone remembering to.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use heck::{ToSnakeCase, ToUpperCamelCase};
use prost::Message as _;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FieldDescriptorProto, FileDescriptorSet};

type BoxError = Box<dyn std::error::Error>;

fn main() -> Result<(), BoxError> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files: Vec<PathBuf> = ["common", "runs", "planner", "policy", "ledger", "toolhost"]
        .iter()
        .map(|f| root.join(format!("warden/v1/{f}.proto")))
        .collect();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut protoc = protoc_bin_vendored::protoc_bin_path()?;
    if let Ok(system) = std::env::var("PROTOC") {
        protoc = PathBuf::from(system);
    }
    // SAFETY: build scripts are single-threaded; tonic-prost-build reads PROTOC from the env.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc);
    }
    let descriptor = out.join("warden_descriptor.bin");
    tonic_prost_build::configure()
        .build_client(std::env::var("CARGO_FEATURE_CLIENT").is_ok())
        .build_server(std::env::var("CARGO_FEATURE_SERVER").is_ok())
        // Clients and servers both go through it; it checks requests on decode (servers).
        .codec_path("crate::codec::CheckedCodec")
        .file_descriptor_set_path(&descriptor)
        .compile_protos(&files, &[root])?;
    let checks = generate_checks(&read_descriptors(&descriptor)?, &[("warden.v1", "crate::v1")])?;
    write_if_changed(&out.join("warden_checks.rs"), &checks)?;

    compile_fixture(&out)?;
    Ok(())
}

/// A contract exercising what warden.v1 does not use yet (maps, oneofs, nested and optional
/// messages, proto3 `optional`, keyword field names), so the generator's unit tests in
/// `src/check.rs` cover every shape of field. Compiled into the crate only under `cfg(test)`.
const FIXTURE_PROTO: &str = r#"
syntax = "proto3";
package warden.fixture;

service Fixture {
  rpc Send(Outer) returns (Reply);
  rpc Stream(Leaf) returns (stream Reply);
}

message Outer {
  string name = 1;
  repeated string tags = 2;
  map<string, string> labels = 3;
  map<string, Inner> inners = 4;
  map<int32, string> numbered = 5;
  Inner parent = 6;
  repeated Inner steps = 7;
  oneof choice {
    string text = 8;
    Inner nested = 9;
    int32 number = 10;
  }
  optional string maybe = 11;
  string type = 12;
  bytes raw = 13;
  Counts counts = 14;
  message Inner {
    string child = 1;
    repeated Leaf leaves = 2;
    Inner again = 3;
  }
}

message Leaf {
  string value = 1;
}

message Counts {
  int32 n = 1;
}

message Reply {
  string text = 1;
  Leaf leaf = 2;
}
"#;

/// Compiles [`FIXTURE_PROTO`] and its checks into `OUT_DIR/check_fixture`. Nothing here is
/// announced to cargo as an input: the files are rewritten only when their text changes.
fn compile_fixture(out: &Path) -> Result<(), BoxError> {
    let dir = out.join("check_fixture");
    let includes = dir.join("proto");
    std::fs::create_dir_all(includes.join("warden/fixture"))?;
    let proto = includes.join("warden/fixture/checks.proto");
    write_if_changed(&proto, FIXTURE_PROTO)?;
    let descriptor = dir.join("descriptor.bin");
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .emit_rerun_if_changed(false)
        .out_dir(&dir)
        .file_descriptor_set_path(&descriptor)
        .compile_protos(&[proto], &[includes])?;
    let checks = generate_checks(&read_descriptors(&descriptor)?, &[("warden.fixture", "crate::check_fixture::pb")])?;
    write_if_changed(&dir.join("checks.rs"), &checks)?;
    Ok(())
}

fn read_descriptors(path: &Path) -> Result<FileDescriptorSet, BoxError> {
    Ok(FileDescriptorSet::decode(std::fs::read(path)?.as_slice())?)
}

/// Writes only on change, so an unchanged file keeps its mtime and does not rebuild the crate.
fn write_if_changed(path: &Path, text: &str) -> std::io::Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    std::fs::write(path, text)
}

/// prost's rule for identifiers that are Rust keywords (prost-build `ident.rs`, not public).
fn sanitize(ident: String) -> String {
    match ident.as_str() {
        "as" | "break" | "const" | "continue" | "else" | "enum" | "false" | "fn" | "for" | "if" | "impl" | "in"
        | "let" | "loop" | "match" | "mod" | "move" | "mut" | "pub" | "ref" | "return" | "static" | "struct"
        | "trait" | "true" | "type" | "unsafe" | "use" | "where" | "while" | "dyn" | "abstract" | "become" | "box"
        | "do" | "final" | "macro" | "override" | "priv" | "typeof" | "unsized" | "virtual" | "yield" | "async"
        | "await" | "try" | "gen" => format!("r#{ident}"),
        "_" | "super" | "self" | "Self" | "extern" | "crate" => format!("{ident}_"),
        s if s.starts_with(|c: char| c.is_numeric()) => format!("_{ident}"),
        _ => ident,
    }
}

/// prost's name for a field, oneof or module.
fn snake(s: &str) -> String {
    sanitize(s.to_snake_case())
}

/// prost's name for a message, oneof enum or variant.
fn camel(s: &str) -> String {
    sanitize(s.to_upper_camel_case())
}

/// One message of the generated packages.
struct Msg<'a> {
    desc: &'a DescriptorProto,
    /// The Rust type, e.g. `crate::v1::Outer` or `crate::v1::outer::Inner`.
    rust: String,
    /// The module holding its nested types and oneof enums, e.g. `crate::v1::outer`.
    module: String,
    proto2: bool,
    map_entry: bool,
}

/// What a field holds, as far as strings are concerned.
enum Kind<'a> {
    Str,
    Msg(&'a str),
    Map { key_is_string: bool, value: Box<Kind<'a>> },
    Other,
}

fn collect<'a>(
    msgs: &mut BTreeMap<String, Msg<'a>>,
    desc: &'a DescriptorProto,
    scope: &str,
    module: &str,
    proto2: bool,
) {
    let name = desc.name();
    let full = format!("{scope}.{name}");
    let own_module = format!("{module}::{}", snake(name));
    for nested in &desc.nested_type {
        collect(msgs, nested, &full, &own_module, proto2);
    }
    let map_entry = desc.options.as_ref().is_some_and(|o| o.map_entry());
    let msg = Msg { desc, rust: format!("{module}::{}", camel(name)), module: own_module, proto2, map_entry };
    msgs.insert(full, msg);
}

fn kind<'a>(msgs: &BTreeMap<String, Msg<'a>>, f: &'a FieldDescriptorProto) -> Kind<'a> {
    match f.r#type() {
        Type::String => Kind::Str,
        Type::Message | Type::Group => {
            let entry = msgs.get(f.type_name()).filter(|m| m.map_entry && f.label() == Label::Repeated);
            match entry {
                Some(entry) => {
                    let field = |n: i32| entry.desc.field.iter().find(|x| x.number() == n);
                    Kind::Map {
                        key_is_string: field(1).is_some_and(|k| k.r#type() == Type::String),
                        value: Box::new(field(2).map_or(Kind::Other, |v| kind(msgs, v))),
                    }
                }
                None => Kind::Msg(f.type_name()),
            }
        }
        _ => Kind::Other,
    }
}

/// Whether a field is a member of a real (not proto3-`optional` synthetic) oneof.
fn in_oneof(f: &FieldDescriptorProto) -> bool {
    f.oneof_index.is_some() && !f.proto3_optional()
}

/// Generates `impl crate::CheckStrings` for every message of `packages` (`(proto package, Rust
/// module)` pairs): a real walk for messages reachable from an RPC input, a no-op for the rest
/// (responses only), and `CHECK_ON_DECODE = true` on the RPC inputs themselves.
fn generate_checks(fds: &FileDescriptorSet, packages: &[(&str, &str)]) -> Result<String, String> {
    let mut msgs = BTreeMap::new();
    let (mut inputs, mut outputs) = (BTreeSet::new(), BTreeSet::new());
    for file in &fds.file {
        let Some((_, module)) = packages.iter().find(|(p, _)| *p == file.package()) else { continue };
        let proto2 = matches!(file.syntax(), "" | "proto2");
        for m in &file.message_type {
            collect(&mut msgs, m, &format!(".{}", file.package()), module, proto2);
        }
        for method in file.service.iter().flat_map(|s| &s.method) {
            inputs.insert(method.input_type().to_string());
            outputs.insert(method.output_type().to_string());
        }
    }

    // Every message a request can carry, following message fields, map values and oneofs.
    let mut reachable: BTreeSet<String> = BTreeSet::new();
    let mut todo: Vec<String> = inputs.iter().cloned().collect();
    while let Some(name) = todo.pop() {
        let Some(m) = msgs.get(&name) else {
            return Err(format!(
                "{name} is carried by a request but lies outside the packages whose string checks \
                 are generated ({packages:?}); extend libs/proto/build.rs"
            ));
        };
        if !reachable.insert(name) {
            continue;
        }
        for f in &m.desc.field {
            let mut k = kind(&msgs, f);
            if let Kind::Map { value, .. } = k {
                k = *value;
            }
            if let Kind::Msg(t) = k {
                todo.push(t.to_string());
            }
        }
    }

    // Messages that (transitively) hold a string: only those need walking.
    let mut stringy: BTreeSet<&str> = BTreeSet::new();
    loop {
        let before = stringy.len();
        for name in &reachable {
            let m = &msgs[name];
            let holds = m.desc.field.iter().any(|f| match kind(&msgs, f) {
                Kind::Str => true,
                Kind::Msg(t) => stringy.contains(t),
                Kind::Map { key_is_string, value } => {
                    key_is_string
                        || matches!(*value, Kind::Str)
                        || matches!(*value, Kind::Msg(t) if stringy.contains(t))
                }
                Kind::Other => false,
            });
            if holds {
                stringy.insert(name.as_str());
            }
        }
        if stringy.len() == before {
            break;
        }
    }

    // The codec tells a request from a response by its type alone: a type that is both would
    // be checked on the client too, where a response must never be refused.
    if let Some(both) = inputs.iter().find(|t| outputs.contains(*t) && stringy.contains(t.as_str())) {
        return Err(format!(
            "{both} is both an RPC input and an RPC output and holds strings; the checked codec \
             cannot check it only on the server. Give the RPCs distinct messages."
        ));
    }

    let mut code = String::from("// @generated by libs/proto/build.rs from the protobuf descriptors.\n");
    for (name, m) in msgs.iter().filter(|(_, m)| !m.map_entry) {
        let body = if stringy.contains(name.as_str()) { walk(&msgs, &stringy, m)? } else { String::new() };
        let path = if body.is_empty() { "_path" } else { "path" };
        let _ = writeln!(code, "impl crate::CheckStrings for {} {{", m.rust);
        if inputs.contains(name) {
            code.push_str("    const CHECK_ON_DECODE: bool = true;\n");
        }
        let _ = writeln!(
            code,
            "    fn check_strings(&self, {path}: &mut ::std::string::String) -> \
             ::std::result::Result<(), crate::FieldViolation> {{\n{body}        ::std::result::Result::Ok(())\n    }}\n}}"
        );
    }
    Ok(code)
}

/// The statements checking one message's strings; `path` names the message itself.
fn walk(msgs: &BTreeMap<String, Msg<'_>>, stringy: &BTreeSet<&str>, m: &Msg<'_>) -> Result<String, String> {
    let mut s = String::new();
    let needs = |k: &Kind<'_>| match k {
        Kind::Str => true,
        Kind::Msg(t) => stringy.contains(t),
        _ => false,
    };
    for f in m.desc.field.iter().filter(|f| !in_oneof(f)) {
        let (name, rust) = (f.name(), snake(f.name()));
        let repeated = f.label() == Label::Repeated;
        let optional = f.proto3_optional() || (f.label() == Label::Optional && m.proto2);
        match kind(msgs, f) {
            Kind::Str if repeated => {
                let _ = writeln!(s, "        crate::check::strings(path, {name:?}, &self.{rust})?;");
            }
            Kind::Str if optional => {
                let _ = writeln!(
                    s,
                    "        if let ::std::option::Option::Some(v) = &self.{rust} {{ crate::check::string(path, {name:?}, v)?; }}"
                );
            }
            Kind::Str => {
                let _ = writeln!(s, "        crate::check::string(path, {name:?}, &self.{rust})?;");
            }
            k @ Kind::Msg(_) if needs(&k) && repeated => {
                let _ = writeln!(s, "        crate::check::messages(path, {name:?}, &self.{rust})?;");
            }
            k @ Kind::Msg(_) if needs(&k) => {
                let _ = writeln!(
                    s,
                    "        if let ::std::option::Option::Some(v) = &self.{rust} {{ crate::check::message(path, {name:?}, v)?; }}"
                );
            }
            Kind::Map { key_is_string, value } => {
                let value_check = match *value {
                    Kind::Str => Some("map_string"),
                    ref k @ Kind::Msg(_) if needs(k) => Some("map_message"),
                    _ => None,
                };
                let key_check = format!("crate::check::map_key(path, {name:?}, k)?;");
                match (key_is_string, value_check) {
                    (false, None) => {}
                    (true, None) => {
                        let _ = writeln!(s, "        for k in self.{rust}.keys() {{ {key_check} }}");
                    }
                    (key, Some(check)) => {
                        let key_check = if key { format!("{key_check} ") } else { String::new() };
                        let _ = writeln!(
                            s,
                            "        for (k, v) in &self.{rust} {{ {key_check}crate::check::{check}(path, {name:?}, k, v)?; }}"
                        );
                    }
                }
            }
            _ => {}
        }
    }
    for (i, oneof) in m.desc.oneof_decl.iter().enumerate() {
        let members: Vec<&FieldDescriptorProto> =
            m.desc.field.iter().filter(|f| in_oneof(f) && f.oneof_index() == i as i32).collect();
        if members.is_empty() {
            continue; // synthetic oneof of a proto3 `optional` field
        }
        // prost renames the enum when a nested type already has its name.
        let mut nested = m.desc.nested_type.iter().map(|t| t.name()).chain(m.desc.enum_type.iter().map(|e| e.name()));
        let clash = nested.any(|t| camel(t) == camel(oneof.name()));
        let enum_path = format!("{}::{}{}", m.module, camel(oneof.name()), if clash { "OneOf" } else { "" });
        let field = snake(oneof.name());
        for f in members {
            let check = match kind(msgs, f) {
                Kind::Str => "string",
                ref k @ Kind::Msg(_) if needs(k) => "message",
                Kind::Map { .. } => return Err(format!("{}: a map cannot be a oneof member", f.name())),
                _ => continue,
            };
            let _ = writeln!(
                s,
                "        if let ::std::option::Option::Some({enum_path}::{}(v)) = &self.{field} {{ crate::check::{check}(path, {:?}, v)?; }}",
                camel(f.name()),
                f.name()
            );
        }
    }
    Ok(s)
}
